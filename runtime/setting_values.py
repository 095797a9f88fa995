"""Settings given as lists, parsed and checked for ServerArgs: the CORS origins (`allowed_origins`) and the
LoRA settings (`lora_paths` as name=path pairs, ranks, slots); `quantization`, `kv_cache_dtype` and the
speculative settings against the settings they cannot go with. Apart from server_args.py, which holds the
fields themselves."""

from __future__ import annotations

import os
from typing import Any


def parse_origins(value: Any) -> list[str]:
    """`allowed_origins` as a list of origins (a comma-separated string too); ValueError naming a bad one."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"allowed_origins must be a list of origins or '*', got {value!r}")
    origins = []
    for item in items:
        for origin in item.split(",") if isinstance(item, str) else [item]:
            origin = origin.strip() if isinstance(origin, str) else origin
            if origin == "*":
                origins.append(origin)
                continue
            scheme, sep, rest = origin.partition("://") if isinstance(origin, str) else ("", "", "")
            if not sep or scheme not in ("http", "https") or not rest or "/" in rest.rstrip("/"):
                raise ValueError(
                    f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], such as "
                    "https://app.example or http://localhost:3000) or '*'"
                )
            origins.append(f"{scheme}://{rest.rstrip('/')}")
    return origins


def parse_lora_paths(value: Any) -> dict[str, str]:
    """`lora_paths` ("name=path" items, a bare path named by its folder; SGLang's spelling) -> {name: path};
    a ValueError naming a bad or repeated item."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"lora_paths must be a list of name=path items, got {value!r}")
    paths: dict[str, str] = {}
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"lora_paths: {item!r} is not a name=path item")
        name, sep, path = item.partition("=")
        if not sep:
            path = item
            name = os.path.basename(os.path.normpath(item))
        name, path = name.strip(), os.path.expanduser(path.strip())
        if not name or not path or ":" in name:
            raise ValueError(f"lora_paths: {item!r} must be name=path, the name non-empty and without ':'")
        if name in paths:
            raise ValueError(f"lora_paths: adapter name {name!r} is given twice")
        paths[name] = path
    return paths


def check_lora_settings(sa: Any) -> None:
    """ServerArgs' LoRA settings: ValueErrors naming the field. Loading adapters is on with lora_paths, and
    where it is on, the drafters that would draft without the adapters are refused (NGRAM's drafts come
    from the request's own text; the target verifies them with the request's adapter). A model split over
    ranks holds each rank's part of every adapter (runtime/lora/shard.py)."""
    for name in ("max_lora_rank", "max_loras_per_batch"):
        v = getattr(sa, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if sa.lora_paths is not None:
        parse_lora_paths(sa.lora_paths)
        sa.enable_lora = True
    if not sa.enable_lora:
        return
    algo = sa.speculative_algorithm
    if algo is not None and str(algo).upper() != "NGRAM":
        raise ValueError(
            f"LoRA adapters (enable_lora / lora_paths) do not run with speculative_algorithm={algo!r} yet: its "
            "draft model or head has no adapters (speculative_algorithm NGRAM does run with them)"
        )


# `quantization`'s names (runtime/quant/apply.py builds their layers): the CPU's weight-only int8 / int4 and
# the GPU's FP8 (FP8 tensor cores; on the CPU torch's reference FP8 matmul, for tests).
QUANTIZATIONS = ("int8", "int4", "fp8")


def check_quantization(sa: Any) -> None:
    """ValueError for a `quantization` that is unknown or cannot run with the other settings: int8 / int4
    run torch's CPU kernels for one whole model in float32 or bfloat16 activations; fp8 runs on FP8
    tensor cores (the device's capability is checked where the device is known: quant/cpu_features.py)
    with half-precision activations, split over ranks with each shard's scales."""
    method = sa.quantization
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} (or None: off), got {method!r}")
    if method == "fp8":
        if sa.device == "cuda" and sa.dtype == "float32":
            raise ValueError(
                "quantization=fp8 on a GPU computes in bfloat16 or float16 (FP8 tensor cores write no float32); "
                "set dtype auto, bfloat16 or float16"
            )
        return
    if sa.device == "cuda":
        raise ValueError(
            f"quantization={method} runs on the CPU only (torch's packed CPU kernels); on a GPU use fp8 or leave "
            "it unset (bf16 weights)"
        )
    if sa.dtype == "float16":
        raise ValueError(f"quantization={method} keeps activations in float32 or bfloat16; got dtype float16")
    if sa.tp_size * sa.pp_size > 1:
        raise ValueError(f"quantization={method} quantizes one whole model: tp_size and pp_size must be 1")


# `kv_cache_dtype`'s names (SGLang's and vLLM's): "auto" is the model's dtype; each other name maps to the
# dtype the KV pool stores (runtime/kvcache/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(sa: Any) -> None:
    """ValueError for a `kv_cache_dtype` that is unknown or that the chosen attention backend cannot read."""
    name = sa.kv_cache_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    if name in FP8_KV_CACHE_DTYPES and sa.attention_backend == "flashinfer":
        raise ValueError(
            f"kv_cache_dtype={name} is read by the triton and torch_native attention backends only; "
            "attention_backend=flashinfer reads the model's dtype (leave kv_cache_dtype at auto, or "
            "choose attention_backend triton)"
        )


SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
# Algorithms whose drafts come from a model (a draft model, an EAGLE head) in the draft model path.
MODEL_DRAFT_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")
GRAMMAR_DRAFT_MODES = ("auto", "on", "off")


def check_speculative(args: Any) -> None:
    """ValueError naming what is wrong with `args`' speculative_* settings; the algorithm's name upper-cased."""
    algo = args.speculative_algorithm
    if algo is not None:
        if not isinstance(algo, str) or algo.upper() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {list(SPECULATIVE_ALGORITHMS)} (or None: off), got {algo!r}"
            )
        args.speculative_algorithm = algo = algo.upper()
    if args.speculative_grammar_drafts not in GRAMMAR_DRAFT_MODES:
        raise ValueError(
            f"speculative_grammar_drafts must be one of {list(GRAMMAR_DRAFT_MODES)}, "
            f"got {args.speculative_grammar_drafts!r}"
        )
    if args.attention_backend == "flashinfer" and (algo is not None or args.speculative_grammar_drafts == "on"):
        raise ValueError(
            "speculative decoding verifies drafts with the torch_native or triton attention backend "
            "(flashinfer has no verify mode): set attention_backend to one of them"
        )
    if args.pp_size > 1 and (algo is not None or args.speculative_grammar_drafts == "on"):
        raise ValueError(
            f"speculative decoding does not verify drafts through pipeline stages (pp_size="
            f"{args.pp_size}): leave speculative_algorithm unset and speculative_grammar_drafts "
            "at auto, or use tp_size"
        )
    if algo in MODEL_DRAFT_ALGORITHMS and not args.speculative_draft_model_path:
        what = "a draft model's folder" if algo == "STANDALONE" else f"the {algo} head's folder"
        raise ValueError(f"speculative_algorithm={algo} needs speculative_draft_model_path ({what})")
    if args.speculative_draft_model_path and algo not in MODEL_DRAFT_ALGORITHMS:
        raise ValueError(
            f"speculative_draft_model_path is set but speculative_algorithm={algo!r} uses no "
            f"draft model (set it to one of {list(MODEL_DRAFT_ALGORITHMS)})"
        )
    for name in (
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "speculative_disable_by_batch_size",
        "speculative_ngram_min_match_window_size",
        "speculative_ngram_max_match_window_size",
    ):
        v = getattr(args, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if args.speculative_ngram_min_match_window_size > args.speculative_ngram_max_match_window_size:
        raise ValueError(
            "speculative_ngram_min_match_window_size "
            f"({args.speculative_ngram_min_match_window_size}) is above "
            f"speculative_ngram_max_match_window_size ({args.speculative_ngram_max_match_window_size})"
        )
    steps, topk, tokens = args.speculative_shape()
    if topk == 1 and tokens > steps + 1:
        raise ValueError(
            f"speculative_num_draft_tokens={tokens} cannot be verified: a chain of "
            f"speculative_num_steps={steps} drafts is {steps + 1} tokens with the last committed one"
        )
    if topk > 1:
        if algo == "NGRAM":
            raise ValueError("speculative_eagle_topk > 1 needs a draft model (NGRAM drafts are chains)")
        candidates = topk + (steps - 1) * topk * topk
        if tokens - 1 > candidates:
            raise ValueError(
                f"speculative_num_draft_tokens={tokens} is more than a tree of speculative_num_steps="
                f"{steps} with speculative_eagle_topk={topk} drafts ({candidates} + 1)"
            )
