"""ModelRunner: owns the model, the KV memory and the attention backend; runs one step.

`__init__` reads as a recipe: resolve device/dtype → build the model and load weights → size the KV pool
→ the pools → the attention context and backend → the forward's parts → capture CUDA graphs and warm up
(on a GPU). Its doors are what a step needs: `run(step)` turns a `StepInput` (plain data: step.py) into a
ForwardBatch, runs the model, computes the logits rows that are needed, and samples; `launch` does the
same without waiting for the device (overlap scheduling: inflight.py), `resolve` reads a launched step
back. It is the scheduler's step runner (scheduler/step_runner.py) and a speculative runner's target
(target_runner.py), states its facts in `info` (runner_info.py), and never sees the scheduler's requests.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..attention import AttentionContext, AttentionHeads, create_attention_backend
from ..forward_batch import ForwardBatch, ForwardMemory
from ..kernel_choices import using as using_kernels
from ..kvcache.kv_quant import check_kv_dtype_supported, kv_cache_dtype, kv_dtype_name
from ..kvcache.memory_pool import KVPool, ReqToTokenPool, TokenAllocator
from ..lora.adapter import LoraShapes
from ..lora.shard import LoraShard
from ..lora.slots import LoraSlots
from ..models.config import ModelConfig
from ..models.cpu_matmul import pack_cpu_linears
from ..models.layers import share_split_k_workspace
from ..models.llama import LlamaForCausalLM
from ..models.parallel import ModelParallel, projection_slices, shard_heads
from ..quant.apply import quantize_linears
from ..quant.cpu_features import auto_cpu_dtype, check_cpu_precision, cpu_features
from ..quant.fp8 import check_fp8_device
from ..server_args import ServerArgs
from ..step import StepInput, StepOutput
from .cuda_graphs import CudaGraphRunner
from .inflight import InFlightSteps, Pending, resolve
from .kv_scales import init_kv_scales
from .loader import load_model, load_model_config
from .piecewise_graphs import PiecewiseGraphs, affordable_max_tokens
from .runner_info import RunnerInfo
from .sampler import StepSampler
from .staging import HostStaging, SampledIdCopies
from .step_forward import StepForward
from .verify import VerifySteps
from .warmup import warm_up_cpu_matmuls, warm_up_prefill

logger = logging.getLogger(__name__)

# Default KV capacity on the CPU, in tokens, when max_total_tokens is not given.
CPU_DEFAULT_KV_TOKENS = 65536
# Upper bound of the automatic GPU sizing. A tiny model on a large GPU would otherwise get hundreds
# of millions of slots: the host-side free list and integrity checks grow with it for no use.
GPU_MAX_AUTO_KV_TOKENS = 1 << 24
# Requests decoded together when max_running_requests is not set (see default_max_running_requests).
CPU_DEFAULT_RUNNING_REQUESTS = 256
GPU_MAX_AUTO_RUNNING_REQUESTS = 1024


class ModelRunner:
    def __init__(
        self,
        server_args: ServerArgs,
        model_path: str,
        parallel: Optional[ModelParallel] = None,
        extra_kv_bytes_per_token: int = 0,
    ):
        """`parallel`: this rank's place in a model split over ranks (runtime/distributed/); None: one
        device holds the whole model. `extra_kv_bytes_per_token`: a drafter's KV pool of the same slots
        (sized together, GPU)."""
        sa = server_args
        parallel = parallel or ModelParallel(device_index=sa.base_gpu_id)
        device = sa.resolved_device()
        if device == "cuda":
            torch.cuda.set_device(parallel.device_index)
        torch.manual_seed(sa.random_seed)

        # The model and its weights.
        self.model_config: ModelConfig = load_model_config(model_path, sa.load_format)
        cfg = self.model_config
        dtype = model_dtype(sa, cfg.checkpoint_dtype)
        context_len = cfg.resolve_context_length(sa.context_length)
        model = load_model(model_path, cfg, sa.load_format, dtype, device, context_len, sa.random_seed, parallel)
        quantization = resolve_quantization(sa.quantization, cfg)
        check_cpu_precision(quantization, dtype, device)
        if quantization == "fp8":
            check_fp8_device(device, dtype, parallel.device_index)
        if quantization is not None:
            quantize_linears(model, quantization, dtype)  # int8 / int4 / fp8 weights (runtime/quant/)
            if device == "cuda":
                share_split_k_workspace(model)  # the new layers too
                torch.cuda.empty_cache()  # the float weights' memory back to the device, for the KV pool
        # LoRA adapters' device slots (with enable_lora), before the KV pool takes what memory is left: this
        # rank's part of each adapter, cut as its shard of the base layers is.
        stage = parallel.stage
        lora_shard = LoraShard.of(
            projection_slices(cfg, parallel.tp), stage.first_layer, stage.layer_count(cfg.num_hidden_layers)
        )
        self.lora = LoraSlots.for_server(sa, LoraShapes.of(cfg), dtype, device, lora_shard)

        # The KV pool's size: this rank's KV heads and layers; every rank of a split model holds the same slots.
        # An FP8 pool (kv_cache_dtype) stores a byte a value: twice the tokens in the same memory.
        kv_heads = shard_heads(cfg, parallel.tp).num_kv_heads
        kv_layers = parallel.stage.layer_count(cfg.num_hidden_layers)
        kv_dtype = kv_cache_dtype(sa.kv_cache_dtype, dtype)
        check_kv_dtype_supported(kv_dtype, device)
        per_token = KVPool.bytes_per_token(kv_layers, kv_heads, cfg.head_dim, kv_dtype) + extra_kv_bytes_per_token
        max_total_tokens = parallel.agree_min(kv_pool_tokens(sa, device, per_token))
        max_running = sa.max_running_requests or default_max_running_requests(device, max_total_tokens)

        # The pools: the table the scheduler writes through, the K/V, the slots it hands out.
        self.req_to_token_pool = ReqToTokenPool(
            max_running + 1, context_len + 8, device, record_writes=parallel.records_table_writes
        )
        self.kv_pool = kv_pool = KVPool(max_total_tokens, kv_layers, kv_heads, cfg.head_dim, kv_dtype, device)
        scales = init_kv_scales(kv_pool, model_path, sa.load_format, parallel.stage.first_layer)
        logger.info(
            "KV cache: %d tokens in %s (%d bytes a token; scales: %s)",
            max_total_tokens,
            kv_dtype_name(kv_dtype),
            per_token,
            scales,
        )
        self.allocator = TokenAllocator(max_total_tokens, device)
        self.info = RunnerInfo(
            device=device,
            dtype=dtype,
            context_len=context_len,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            eos_token_ids=tuple(cfg.eos_token_ids),
            max_total_tokens=max_total_tokens,
            max_running_requests=max_running,
            attention_backend=sa.resolved_attention_backend(),
            # Launching a step before the previous one is read back pays only where the device runs
            # asynchronously; on the CPU a launch runs synchronously.
            supports_overlap=device == "cuda",
            tp_size=parallel.tp.size,
            kv_cache_bytes=kv_pool.nbytes(),
            weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            quantization=quantization or "none",
            kv_cache_dtype=kv_dtype_name(kv_dtype),
            cpu_features=tuple(cpu_features().describe()) if device == "cpu" else (),
        )

        # The attention backend, and the parts a step runs through.
        heads = AttentionHeads.split(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, parallel.tp.size)
        self.attention = AttentionContext(
            device, heads, dtype, max_total_tokens, sa.disable_cascade_attention, kv_dtype=kv_dtype
        )
        backend = create_attention_backend(self.info.attention_backend, self.attention)
        self.memory = ForwardMemory(self.req_to_token_pool, kv_pool, backend)
        # Every forward and graph capture runs inside this runner's kernel choices (kernel_choices.py).
        self.forward = StepForward(model, self.memory, HostStaging(device), sa.kernel_choices(), self.lora)
        self.sampler = StepSampler(cfg.vocab_size)
        # The LM head at some tokens, for rows a grammar narrows (one device: every vocabulary row is here).
        self._logits_at = model.logits_at if parallel.tp.size == 1 else None
        self.inflight = InFlightSteps(self.forward, self.sampler, SampledIdCopies(device, max_running + 1))
        self.verify = VerifySteps(self.forward, cfg.vocab_size)  # VERIFY steps (speculative decoding)

        if device == "cuda" and not sa.disable_cuda_graph and backend.supports_cuda_graph:
            max_bs = min(sa.cuda_graph_max_bs or max_running, max_running)
            with using_kernels(self.forward.kernel_choices):
                self.forward.graphs = CudaGraphRunner(model, self.memory, cfg.vocab_size, max_bs, self.lora)
                if sa.piecewise_cuda_graph_max_tokens and self.lora is None and PiecewiseGraphs.supports(model):
                    torch.cuda.empty_cache()  # (the graphs' private pool cannot use the allocator's cached blocks)
                    free = torch.cuda.mem_get_info()[0]
                    tokens = affordable_max_tokens(
                        sa.piecewise_cuda_graph_max_tokens, PiecewiseGraphs.bytes_per_token(model), free
                    )
                    if tokens < sa.piecewise_cuda_graph_max_tokens:
                        logger.warning(
                            "piecewise CUDA graphs up to %d tokens, not %d: %.1f GB of device memory are free after "
                            "the KV cache (lower mem_fraction_static for more)",
                            tokens,
                            sa.piecewise_cuda_graph_max_tokens,
                            free / 2**30,
                        )
                    if tokens:
                        self.forward.piecewise = PiecewiseGraphs(model, self.memory, tokens)
        if device == "cuda":
            warm_up_prefill(self.run, self.allocator, self.req_to_token_pool, cfg.vocab_size)
        else:
            pack_cpu_linears(model)
            warm_up_cpu_matmuls(model)

    @property
    def model(self) -> LlamaForCausalLM:
        """The model (this rank's shard of it), which every forward of this runner runs."""
        return self.forward.model

    # ------------------------------------------------------------------ the step runner's doors
    @torch.inference_mode()
    def run(self, step: StepInput, prev: Optional[Pending] = None) -> StepOutput:
        """Run the step and read its results back. `prev`: the step still in flight (`launch`'s handle)
        whose sampled tokens are some of this step's input ids (`step.prev_src`)."""
        f = self.forward
        with using_kernels(f.kernel_choices):
            if step.mode.is_verify():
                return self.verify.run(step)[0]
            fb = f.batch(step, input_ids=prev.next_ids if prev is not None else None)
            replayed = f.replay_graph(fb)
            if replayed is not None:
                # Decode: the graph computes the logits of every row too (one row per request), and their argmax.
                logits, greedy = replayed  # (B, vocab) float32, (B,)
                return self.sampler.sample_step(step, f.model.compute_logits, None, logits, greedy)
            hidden, rows = f.eager(fb, step.sample_rows)
            return self.sampler.sample_step(
                step, f.model.compute_logits, hidden, sample_rows_t=rows, logits_at=self._logits_at
            )

    @torch.inference_mode()
    def launch(self, step: StepInput, prev: Optional[Pending] = None) -> Pending:
        """Start a step without waiting for it (overlap scheduling); `resolve` reads it back. Only for
        steps whose sampling needs nothing from the host (no row `needs_host_sampling`; never VERIFY)."""
        if step.mode.is_verify():
            raise ValueError("launch: a VERIFY step is read back at once; run() it")
        with using_kernels(self.forward.kernel_choices):
            if step.mode.is_decode():
                return self.inflight.launch_decode(step, prev)
            return self.inflight.launch_prefill(step, prev)

    def resolve(self, pending: Pending) -> StepOutput:
        """Wait for a launched step (`PendingDecode` or `PendingPrefill`) and read its tokens."""
        return resolve(pending)

    # ------------------------------------------------------------------ a speculative runner's target
    @torch.inference_mode()
    def run_with_hidden(
        self, step: StepInput, capture_layers: tuple = ()
    ) -> tuple[StepOutput, torch.Tensor, ForwardBatch]:
        """A prefill or decode step run eagerly: (its output, the hidden states of all its rows (T, hidden),
        the forward batch, with the inputs of `capture_layers` in fb.captured_hidden), for a drafter."""
        f = self.forward
        with using_kernels(f.kernel_choices):
            fb = f.batch(step)
            if capture_layers:
                fb.capture_layers, fb.captured_hidden = capture_layers, []
            hidden, rows = f.eager(fb, step.sample_rows)
            return (
                self.sampler.sample_step(
                    step, f.model.compute_logits, hidden, sample_rows_t=rows, logits_at=self._logits_at
                ),
                hidden,
                fb,
            )

    @torch.inference_mode()
    def run_verify(self, step: StepInput, capture_layers: tuple = ()) -> tuple[StepOutput, torch.Tensor, Any]:
        """A VERIFY step: (what each request accepted, the nodes' hidden states (T, hidden), the forward
        batch, with the hidden states of `capture_layers` in fb.captured_hidden)."""
        with using_kernels(self.forward.kernel_choices):
            return self.verify.run(step, capture_layers)

    def capture_verify_graphs(self, nodes: int, max_bs: int, capture_layers: tuple = ()) -> None:
        """CUDA graphs for VERIFY steps of up to `nodes` tokens per request, where decode steps run as
        graphs (speculating on a GPU); nothing elsewhere."""
        if self.forward.graphs is None:
            return
        with using_kernels(self.forward.kernel_choices):
            self.verify.capture_graphs(nodes, max_bs, capture_layers)

    # ------------------------------------------------------------------ a pipeline's first stage
    @torch.inference_mode()
    def sample_hidden(self, step: StepInput, hidden: torch.Tensor) -> StepOutput:
        """Sample the step from its final hidden states (T, hidden), computed elsewhere (a pipeline's
        last stage): logits, logprobs and tokens as `run` gives them."""
        f = self.forward
        with using_kernels(f.kernel_choices):
            rows = f.upload_rows(step.sample_rows)
            return self.sampler.sample_step(
                step, f.model.compute_logits, hidden, sample_rows_t=rows, logits_at=self._logits_at
            )


def model_dtype(server_args: ServerArgs, checkpoint_dtype: Optional[str]) -> torch.dtype:
    """The weights' dtype: ServerArgs.dtype, where "auto" reads the checkpoint on a GPU and the CPU's features
    on a CPU (bfloat16 with AMX or AVX512-BF16, else float32: quant/cpu_features.py)."""
    on_cpu = server_args.resolved_device() == "cpu"
    return server_args.resolved_dtype(checkpoint_dtype, cpu_auto=auto_cpu_dtype() if on_cpu else "float32")


def resolve_quantization(requested: Optional[str], cfg: ModelConfig) -> Optional[str]:
    """The weights' quantization: `requested` (ServerArgs.quantization), or fp8 for an FP8 checkpoint, which
    takes no other (its weights are FP8 already; a ValueError names the clash)."""
    if cfg.fp8_checkpoint is None:
        return requested
    if requested not in (None, "fp8"):
        raise ValueError(
            f"quantization={requested} with an FP8 checkpoint (config.json's quantization_config: "
            f"{cfg.fp8_checkpoint.method}); leave quantization unset or fp8"
        )
    return "fp8"


def kv_pool_tokens(server_args: ServerArgs, device: str, bytes_per_token: int) -> int:
    """The KV pool's slots: `max_total_tokens` when set; else on a GPU what `mem_fraction_static` of its
    memory leaves after the weights, at `bytes_per_token` (the target's and a drafter's K/V of a token),
    at most GPU_MAX_AUTO_KV_TOKENS; on the CPU CPU_DEFAULT_KV_TOKENS."""
    sa = server_args
    if sa.max_total_tokens is not None:
        return sa.max_total_tokens
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = total * sa.mem_fraction_static - used
        if budget <= 0:
            raise RuntimeError(f"no GPU memory left for the KV cache (mem_fraction_static={sa.mem_fraction_static})")
        return int(min(budget // bytes_per_token, GPU_MAX_AUTO_KV_TOKENS))
    return CPU_DEFAULT_KV_TOKENS


def default_max_running_requests(device: str, max_total_tokens: int) -> int:
    """CPU: 256 (a step's cost grows with the batch: larger batches only add latency). GPU: 1,024, so a
    decode step's matmuls run at a batch where the tensor cores are busy, but no more requests than
    the KV pool holds at 128 tokens each (a small pool would otherwise retract all the time); the
    per-request table rows cost (context_len + 8) * 4 bytes each on the device and on the host."""
    if device != "cuda":
        return CPU_DEFAULT_RUNNING_REQUESTS
    return max(1, min(GPU_MAX_AUTO_RUNNING_REQUESTS, max_total_tokens // 128))
