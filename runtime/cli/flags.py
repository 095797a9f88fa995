"""The settings' command-line flags: one per field of a settings dataclass (ServerArgs, RouterArgs), the
choices a flag offers, and the one line of `--help` each gets (docs/server_args.md says more)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..router.args import ROUTING_POLICIES
from ..server_args import (
    ATTENTION_BACKENDS,
    DTYPES,
    GRAMMAR_BACKENDS,
    LOAD_FORMATS,
    SCHEDULE_POLICIES,
)
from ..setting_values import GRAMMAR_DRAFT_MODES, KV_CACHE_DTYPES, QUANTIZATIONS


def add_dataclass_flags(
    parser: argparse.ArgumentParser, cls, help_text: dict[str, str], choices: dict[str, tuple]
) -> None:
    """One flag per field of dataclass `cls` (`--max-total-tokens` for max_total_tokens): booleans are
    bare flags, lists take one or more values, the type follows the default."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        text = help_text[f.name]
        if f.type in ("bool",) or isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default, help=text)
            continue
        if str(f.type).startswith("list"):
            parser.add_argument(flag, dest=f.name, nargs="+", default=[], required=True, help=text)
            continue
        if str(f.type).startswith("Optional[list"):  # (allowed_origins): absent is None
            parser.add_argument(flag, dest=f.name, nargs="+", default=None, help=text)
            continue
        typ = str
        if isinstance(default, int) or "int" in str(f.type):
            typ = int
        if isinstance(default, float) or "float" in str(f.type):
            typ = float
        if default is not None:
            text += " (default: %(default)s)"
        kwargs: dict[str, Any] = {"type": typ, "default": default, "help": text}
        if f.name in choices:
            kwargs["choices"] = choices[f.name]
        parser.add_argument(flag, dest=f.name, **kwargs)


def settings_from_args(cls, args: argparse.Namespace) -> Any:
    """The settings dataclass `cls` from parsed flags (its __post_init__ checks the values)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# The flags whose values are one of a few names.
CLI_CHOICES = {
    "load_format": LOAD_FORMATS,
    "dtype": DTYPES,
    "quantization": QUANTIZATIONS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "device": ("auto", "cpu", "cuda"),
    "schedule_policy": SCHEDULE_POLICIES,
    "attention_backend": ATTENTION_BACKENDS,
    "grammar_backend": GRAMMAR_BACKENDS,
    "speculative_grammar_drafts": GRAMMAR_DRAFT_MODES,
}
ROUTER_CLI_CHOICES = {"policy": ROUTING_POLICIES}


# `plait serve --help`: one line per setting (docs/server_args.md says more).
CLI_HELP = {
    "model_path": "a local Hugging Face folder; omitted: the embedded SmolLM2-135M-Instruct; with "
    "--load-format dummy also a built-in shape (llama-3.1-8b, llama-3.2-1b, smollm2-135m)",
    "tokenizer_path": "a tokenizer folder other than the model's",
    "load_format": "auto: safetensors from the folder; dummy: random weights at the model's shape",
    "dtype": "auto: on CUDA float16 for a float16 checkpoint, else bfloat16; float32 on the CPU",
    "quantization": "the linear layers' weights: fp8 (GPU FP8 tensor cores, per-channel scales; implied by an FP8 "
    "checkpoint), or CPU weight-only int8 (per output channel) / int4 (groups of 32); default: off (--dtype)",
    "device": "auto: CUDA when available",
    "context_length": "longest prompt + output of a request (default: the model's)",
    "served_model_name": "model name the APIs report (default: the model path as given)",
    "random_seed": "the runtime's random seed",
    "max_total_tokens": "tokens the KV cache holds (default: sized from free memory)",
    "mem_fraction_static": "GPU: share of device memory for weights and KV cache",
    "page_size": "tokens per KV page",
    "kv_cache_dtype": "what the KV cache stores: auto (the model's dtype), bf16, fp8_e4m3 (alias fp8) or "
    "fp8_e5m2 (one byte a value, a scale per layer: twice the tokens; GPU: compute capability 8.9+)",
    "enable_hierarchical_cache": "HiCache: prefixes evicted from the device kept in host memory, loaded back on a hit",
    "hicache_ratio": "host tier size in device-pool tokens (host tokens = ratio x the device pool)",
    "hicache_size": "host tier size in GB (overrides --hicache-ratio when > 0)",
    "hicache_write_policy": "write_through (copy to the host after prefill) or write_back (copy when evicted)",
    "hicache_load_policy": "wait (the step that reads a loaded-back prefix waits for its copy) or hold (the request "
    "waits for it, the other requests' steps go on; one device)",
    "max_running_requests": "requests decoded together (default: 256 on the CPU, up to 1,024 on a GPU)",
    "max_prefill_tokens": "prompt tokens one prefill step may take",
    "chunked_prefill_size": "longer prompts are prefilled in chunks of this many tokens",
    "schedule_policy": "waiting-queue order: lpm (longest cached prefix first), dfs-weight, fcfs",
    "disable_radix_cache": "no prefix reuse between requests",
    "max_queued_requests": "requests that may wait beyond the running ones; past it: 503 (default: unlimited)",
    "stream_interval": "tokens between two chunks of a streamed response",
    "max_num_batched_tokens": "tokens one step may take, running requests' decode tokens first, then prefill "
    "chunks (default: chunked_prefill_size)",
    "long_prefill_token_threshold": "a prompt prefills at most this many tokens a step; the rest of the step's "
    "budget goes to other waiting prompts (default 0: no limit)",
    "disable_mixed_chunk": "a step either decodes the running requests or prefills, never both in one forward",
    "schedule_conservativeness": "scales the KV the admission reserves for running requests' outputs: below 1 "
    "admits more (and retracts more), above 1 fewer",
    "attention_backend": "auto: triton on CUDA, torch_native on the CPU; flashinfer needs its package",
    "disable_cuda_graph": "GPU: run decode steps eagerly",
    "cuda_graph_max_bs": "GPU: largest decode batch captured as a CUDA graph (default: every size)",
    "piecewise_cuda_graph_max_tokens": "GPU: mixed, prefill and large decode steps of up to this many tokens "
    "run as CUDA graphs between their attention kernels (default 1024; 0: eagerly)",
    "disable_overlap_schedule": "GPU: read each step back before launching the next",
    "disable_cascade_attention": "GPU: do not read a prefix that running requests share once per tile",
    "disable_decode_gemm": "GPU: decode batches of 2-64 rows use cuBLAS instead of plait's decode matmul",
    "enable_fused_decode_row": "GPU: batch-1 decode steps fold RMSNorm / SiLU-and-mul into the "
    "matmuls (measured slower)",
    "enable_pdl": "GPU (Hopper): programmatic dependent launch between kernels",
    "disable_prefill_pipeline": "GPU: read each prefill step back before launching the next",
    "num_threads": "CPU torch threads of the scheduler (default: one per core; 1 is much faster on a "
    "machine other processes keep busy)",
    "tp_size": "tensor parallel ranks per model: each holds its share of every layer's heads and MLP",
    "pp_size": "pipeline parallel stages per model: each holds a contiguous run of layers",
    "dp_size": "data parallel replicas on this machine, each its own scheduler and KV cache",
    "nnodes": "machines one model's ranks run on",
    "node_rank": "this machine's index among nnodes (0 serves HTTP; the others run their ranks only)",
    "dist_init_addr": "host:port of node 0's rank rendezvous (needed with nnodes > 1)",
    "base_gpu_id": "GPU of this node's first rank (local rank i on base_gpu_id + i)",
    "dist_timeout": "seconds ranks wait for each other at start-up and in one collective",
    "enable_step_timing": "device time per step in get_stats()['steps'] (benchmarks)",
    "grammar_backend": "backend of regex / JSON schema / EBNF constraints",
    "disable_jump_forward": "decode every token of a constrained output, even those the grammar fixes",
    "grammar_compile_timeout": "seconds a grammar may compile before its request fails",
    "speculative_algorithm": "speculative decoding: NGRAM (prompt lookup), STANDALONE (a draft model), EAGLE, EAGLE3",
    "speculative_draft_model_path": "STANDALONE: the draft model's folder (same tokenizer); "
    "EAGLE/EAGLE3: the head's folder",
    "speculative_num_steps": "draft depth (default: 12 for NGRAM, 3 with a draft model)",
    "speculative_eagle_topk": "branching of a draft model's tree at each step (1: chains)",
    "speculative_num_draft_tokens": "tokens verified per request and step, the last committed one included",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix looked up in the request's tokens",
    "speculative_ngram_max_match_window_size": "NGRAM: longest suffix looked up in the request's tokens",
    "speculative_grammar_drafts": "on: grammar-forced tokens as drafts instead of jump-forward (outputs exactly "
    "plain constrained decoding's); auto: on with --speculative-algorithm; off",
    "speculative_disable_by_batch_size": "no speculation when more requests run (default: 8 on the CPU, 32 on a GPU)",
    "disable_speculative_adaptive": "always propose the full draft length (no per-request adaptation or off switch)",
    "enable_lora": "serve LoRA adapters (on by itself with --lora-paths; else loaded by /load_lora_adapter)",
    "lora_paths": "LoRA adapters to load at start-up: name=path PEFT folders (a bare path is named by its folder)",
    "max_lora_rank": "the highest rank an adapter may have (the device slots are this wide)",
    "max_loras_per_batch": "distinct LoRA adapters one step runs (device slots; more may be loaded, swapped in)",
    "host": "address the server listens on",
    "port": "port the server listens on",
    "api_key": "require 'Authorization: Bearer <key>' (/health, /metrics and /health_generate stay open)",
    "allowed_origins": "CORS: origins whose web pages may call the server (https://app.example ..., or '*'); "
    "default: none",
    "log_level": "server log level",
    "require_api_key_for_probes": "with --api-key: /metrics and /health_generate ask for the key too",
    "kv_events_endpoint": "publish the prefix cache's changes as vLLM's KV events on this ZMQ address "
    "(tcp://*:5557 binds, tcp://host:port connects)",
    "kv_events_block_size": "tokens per block of the KV events (a multiple of --page-size)",
}
ROUTER_CLI_HELP = {
    "worker_urls": "the replicas (each a `plait serve`), e.g. http://10.0.0.1:30000 http://10.0.0.2:30000",
    "host": "address the router listens on",
    "port": "port the router listens on",
    "policy": "cache_aware: the replica most likely to hold the prompt's prefix; round_robin: in turn",
    "balance_abs_threshold": "cache-aware: in-flight requests by which loads may differ before balancing wins",
    "balance_rel_threshold": "cache-aware: ratio by which loads may differ before balancing wins",
    "cache_threshold": "cache-aware: share of a prompt a replica must hold to win it on its prefix",
    "max_tree_items": "prefix characters (or token ids) remembered per replica",
    "health_check_interval": "seconds between two /health checks of each replica",
    "health_failure_threshold": "failed checks in a row that take a replica out",
    "request_timeout": "seconds a replica may take to answer one request",
    "log_level": "router log level",
}
