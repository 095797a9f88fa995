"""ModelRunner: owns the model, the KV memory and the attention backend; runs one step.

`__init__` reads as a recipe: resolve device/dtype → build model and load weights → size the KV pool
→ build the attention backend (→ capture CUDA graphs, on GPU). `run(step)` turns a `StepInput` (plain
data: step.py) into a ForwardBatch, runs the model, computes the logits rows that are needed, and
samples. `launch` does the same without waiting for the device (overlap scheduling): the sampled ids stay
on the device with a pinned host copy that `resolve` reads later. It is the scheduler's step runner
(scheduler/step_runner.py) and never sees the scheduler's requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..attention import create_attention_backend
from ..forward_batch import ForwardBatch
from ..kernel_choices import using as using_kernels
from ..kvcache.memory_pool import KVPool, ReqToTokenPool, TokenAllocator
from ..models.config import ModelConfig
from ..models.parallel import ModelParallel, shard_heads
from ..server_args import ServerArgs
from ..step import SamplingRow, StepInput, StepOutput
from .loader import load_model, load_model_config
from .sampler import SamplingBatchInfo, apply_logit_adjustments, compute_logprobs, greedy_tokens, sample
from .verify import VerifySteps, set_verify_tree
from .warmup import warm_up_prefill

logger = logging.getLogger(__name__)

# Default KV capacity on the CPU, in tokens, when max_total_tokens is not given.
CPU_DEFAULT_KV_TOKENS = 65536
# Upper bound of the automatic GPU sizing. A tiny model on a large GPU would otherwise get hundreds
# of millions of slots: the host-side free list and integrity checks grow with it for no use.
GPU_MAX_AUTO_KV_TOKENS = 1 << 24
# Requests decoded together when max_running_requests is not set (see default_max_running_requests).
CPU_DEFAULT_RUNNING_REQUESTS = 256
GPU_MAX_AUTO_RUNNING_REQUESTS = 1024


@dataclass
class PendingDecode:
    """A decode step launched but not yet read back."""

    next_ids: torch.Tensor  # (B,) int64 on the device
    host: torch.Tensor  # (B,) pinned host copy, valid once `event` completes
    event: Optional["torch.cuda.Event"]  # None on the CPU
    # Every request plain greedy: stays true along a chain of launched steps (their requests are a
    # subset of the first step's, and a request's sampling settings do not change), so it is computed once.
    plain_greedy: bool = False


@dataclass
class PendingPrefill:
    """A prefill (EXTEND) step launched but not yet read back (see `ModelRunner.launch_prefill`)."""

    next_ids: torch.Tensor  # (S,) int64 on the device: the tokens of the S requests that sample
    host: torch.Tensor  # (S,) pinned host copy, valid once `event` completes
    event: Optional["torch.cuda.Event"]  # None on the CPU
    sampling_reqs: list[int]  # (S,) index in the batch of each sampled row
    batch_size: int


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
        self.server_args = server_args
        self.parallel = parallel = parallel or ModelParallel(device_index=server_args.base_gpu_id)
        self.tp_size = parallel.tp.size  # (the triton backend sizes its scratch per rank's heads)
        self._extra_kv_bytes = extra_kv_bytes_per_token
        self.device = server_args.resolved_device()
        # Launching a step before the previous one is read back pays only where the device runs
        # asynchronously; on the CPU a launch runs synchronously.
        self.supports_overlap = self.device == "cuda"
        self._masker = None  # constrained.masker.GrammarMasker, made for the first constrained step
        # Every forward and graph capture runs inside this runner's kernel choices (kernel_choices.py).
        self.kernel_choices = server_args.kernel_choices()
        if self.device == "cuda":
            torch.cuda.set_device(parallel.device_index)
        torch.manual_seed(server_args.random_seed)

        self.model_config: ModelConfig = load_model_config(model_path, server_args.load_format)
        cfg = self.model_config
        self.dtype = server_args.resolved_dtype(cfg.checkpoint_dtype)
        self.context_len = cfg.resolve_context_length(server_args.context_length)
        self.model = load_model(
            model_path,
            cfg,
            server_args.load_format,
            self.dtype,
            self.device,
            self.context_len,
            server_args.random_seed,
            parallel,
        )
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = tuple(cfg.eos_token_ids)

        # This rank's KV heads and layers; every rank of a split model holds the same slots.
        self.kv_heads = shard_heads(cfg, parallel.tp).num_kv_heads
        self.kv_layers = parallel.stage.layer_count(cfg.num_hidden_layers)
        self.max_total_tokens = parallel.agree_min(self._size_kv_pool())
        self.max_running_requests = server_args.max_running_requests or default_max_running_requests(
            self.device, self.max_total_tokens
        )
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + 1,
            self.context_len + 8,
            self.device,
            record_writes=parallel.records_table_writes,
        )
        self.kv_pool = KVPool(
            self.max_total_tokens, self.kv_layers, self.kv_heads, cfg.head_dim, self.dtype, self.device
        )
        self.allocator = TokenAllocator(self.max_total_tokens, self.device)
        self.memory_bytes = {
            "kv_cache_bytes": self.kv_pool.nbytes(),
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
        }
        self.attention_backend = server_args.resolved_attention_backend()
        self.attn_backend = create_attention_backend(self.attention_backend, self)
        self.verify = VerifySteps(self)  # VERIFY steps (speculative decoding)
        self._staging = [(None, None)] * 4  # pinned host buffers for per-step inputs (GPU) + their copy events
        self._staging_pos = 0
        # Pinned buffers receiving the sampled tokens of overlapped steps: one pair for decode steps, one
        # for prefill steps (a prefill may be launched while the last decode step's copy is unread).
        self._host_rings: dict[str, list[torch.Tensor]] = {}
        self._ring_pos: dict[str, int] = {"decode": 0, "prefill": 0}
        self.graph_runner = None
        if self.device == "cuda" and not server_args.disable_cuda_graph and self.attn_backend.supports_cuda_graph:
            from .cuda_graphs import CudaGraphRunner

            with using_kernels(self.kernel_choices):
                self.graph_runner = CudaGraphRunner(self)
        if self.device == "cuda":
            warm_up_prefill(self)

    def _size_kv_pool(self) -> int:
        cfg, sa = self.model_config, self.server_args
        if sa.max_total_tokens is not None:
            return sa.max_total_tokens
        per_token = (
            KVPool.bytes_per_token(self.kv_layers, self.kv_heads, cfg.head_dim, self.dtype) + self._extra_kv_bytes
        )
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            used = total - free
            budget = total * sa.mem_fraction_static - used
            if budget <= 0:
                raise RuntimeError(
                    f"no GPU memory left for the KV cache (mem_fraction_static={sa.mem_fraction_static})"
                )
            return int(min(budget // per_token, GPU_MAX_AUTO_KV_TOKENS))
        return CPU_DEFAULT_KV_TOKENS

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, step: StepInput, prev=None) -> StepOutput:
        """Run the step and read it back. `prev`: the step still in flight (`launch`'s handle) whose
        sampled tokens are some of this step's input ids (`step.prev_src`)."""
        with using_kernels(self.kernel_choices):
            if step.mode.is_verify():
                return self.verify.run(step)[0]
            return self._run(step, prev)

    def _run(self, step: StepInput, prev=None) -> StepOutput:
        fb = self._build_forward_batch(step, prev_ids=prev.next_ids if prev is not None else None)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            # Decode: the graph computes the logits of every row too (one row per request), and their argmax.
            logits, greedy = self.graph_runner.replay(fb)  # (B, vocab) float32, (B,)
            return self._sample(step, None, logits, greedy)
        hidden, rows = self._forward_eager(fb, step.sample_rows)
        return self._sample(step, hidden, sample_rows_t=rows)

    @torch.inference_mode()
    def run_with_hidden(self, step: StepInput, capture_layers: tuple = ()):
        """A prefill or decode step run eagerly: (its output, the hidden states of all its rows (T, hidden),
        the forward batch, with the inputs of `capture_layers` in fb.captured_hidden), for a drafter."""
        with using_kernels(self.kernel_choices):
            fb = self._build_forward_batch(step)
            if capture_layers:
                fb.capture_layers, fb.captured_hidden = capture_layers, []
            hidden, rows = self._forward_eager(fb, step.sample_rows)
            return self._sample(step, hidden, sample_rows_t=rows), hidden, fb

    @torch.inference_mode()
    def run_verify(self, step: StepInput, capture_layers: tuple = ()):
        """A VERIFY step: (what each request accepted, the nodes' hidden states (T, hidden), the forward
        batch, with the hidden states of `capture_layers` in fb.captured_hidden)."""
        with using_kernels(self.kernel_choices):
            return self.verify.run(step, capture_layers)

    def capture_verify_graphs(self, nodes: int, max_bs: int, capture_layers: tuple = ()) -> None:
        """CUDA graphs for VERIFY steps of up to `nodes` tokens per request (speculating on a GPU)."""
        with using_kernels(self.kernel_choices):
            self.verify.capture_graphs(nodes, max_bs, capture_layers)

    @torch.inference_mode()
    def launch(self, step: StepInput, prev=None):
        """Start a step without waiting for it (overlap scheduling); `resolve` reads it back. Only for
        steps whose sampling needs nothing from the host (no row `needs_host_sampling`; never VERIFY)."""
        if step.mode.is_verify():
            raise ValueError("launch: a VERIFY step is read back at once; run() it")
        with using_kernels(self.kernel_choices):
            if step.mode.is_decode():
                return self._launch_decode(step, prev)
            return self._launch_prefill(step, prev)

    def _forward_eager(self, fb: ForwardBatch, sample_rows: list[int]):
        """The model on `fb` without a graph: (T, hidden) states and the (S,) device rows to sample."""
        self.attn_backend.init_forward_metadata(fb)
        # NOTE: the rows to sample are uploaded before the forward is queued: an upload from a Python list
        # after it waits for the whole forward (a pageable copy syncs the stream), and only then could
        # the LM head and the sampling be queued.
        rows = self._upload([sample_rows])[0] if sample_rows else None
        return self.model(fb.input_ids, fb.positions, fb), rows  # (T, hidden), (S,)

    # ------------------------------------------------------------------ a split model's other ranks
    @torch.inference_mode()
    def follow(self, step: StepInput, launched: bool, input_ids: Optional[torch.Tensor] = None) -> None:
        """A tensor-parallel worker rank's part of a step that rank 0 runs (`run`, or `launch` when
        `launched`): the same forward and the same logits computations, in the same order, and no
        sampling. Each of them holds collectives that every rank must reach in turn; rank 0 samples
        (runtime/distributed/). `input_ids`: the previous step's sampled tokens, when the step takes
        them from the device (`ids_from_prev`)."""
        with using_kernels(self.kernel_choices):
            if step.mode.is_verify():  # every node is scored (VerifySteps.run's eager path: no verify graphs here)
                fb = self._build_forward_batch(step)
                self.attn_backend.init_forward_metadata(fb)
                self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))
                return
            fb = self._build_forward_batch(step, prev_ids=input_ids if step.ids_from_prev else None)
            if self.graph_runner is not None and self.graph_runner.can_run(fb):
                self.graph_runner.replay(fb)  # the logits are computed inside the graph
                return
            hidden, rows = self._forward_eager(fb, step.sample_rows)
            self._follow_logits(step, hidden, launched, rows)

    @torch.inference_mode()
    def follow_logits(self, step: StepInput, hidden: torch.Tensor) -> None:
        """`follow`'s logits part alone, from hidden states (T, hidden) computed elsewhere (the first
        pipeline stage's tensor-parallel ranks, while rank 0 runs `sample_hidden`)."""
        with using_kernels(self.kernel_choices):
            self._follow_logits(step, hidden, launched=False)

    def _follow_logits(
        self, step: StepInput, hidden: torch.Tensor, launched: bool, sample_rows_t: Optional[torch.Tensor] = None
    ) -> None:
        if step.logprob_rows and not launched:  # as _sample: the prompt logprobs' rows first
            self.model.compute_logits(hidden[[lr.row for lr in step.logprob_rows]])
        if step.sample_rows:
            self.model.compute_logits(hidden[step.sample_rows if sample_rows_t is None else sample_rows_t])

    def forward_batch(self, step: StepInput) -> ForwardBatch:
        """The step's ForwardBatch with its attention metadata (its new tokens' slots written into the
        table): for runners that run the model themselves (a pipeline stage)."""
        fb = self._build_forward_batch(step)
        self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.inference_mode()
    def sample_hidden(self, step: StepInput, hidden: torch.Tensor) -> StepOutput:
        """Sample the step from its final hidden states (T, hidden), computed elsewhere (a pipeline's
        last stage): logits, logprobs and tokens as `run` gives them."""
        with using_kernels(self.kernel_choices):
            rows = self._upload([step.sample_rows])[0] if step.sample_rows else None
            return self._sample(step, hidden, sample_rows_t=rows)

    # ------------------------------------------------------------------ overlapped steps
    def _launch_decode(self, step: StepInput, prev: Optional["PendingDecode"]) -> "PendingDecode":
        """A decode step. With `prev` (the step still in flight), the input tokens are prev's sampled
        tokens, read on the device, and each request is one token further along than its host state
        says (`step.ids_from_prev`); prev's requests may be a superset of the step's (some finished
        meanwhile): the step's last row names the rows of prev that go on."""
        fb = self._build_forward_batch(step, prev_ids=prev.next_ids if prev is not None else None)
        greedy = None
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            logits, greedy = self.graph_runner.replay(fb)
        else:
            self.attn_backend.init_forward_metadata(fb)
            logits = self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))
        chained = isinstance(prev, PendingDecode) and step.all_ids_from_prev  # (a subset of prev's requests)
        plain_greedy = prev.plain_greedy if chained else all(r.plain_greedy() for r in step.sampling)
        next_ids = self._sample_on_device(logits, step.sampling, plain_greedy, greedy)
        host, event = self._copy_to_host(next_ids, "decode")
        return PendingDecode(next_ids, host, event, plain_greedy)

    def _launch_prefill(self, step: StepInput, prev=None) -> PendingPrefill:
        """A prefill (EXTEND) step, mixed or not: the sampled tokens stay on the device, with a pinned host
        copy that `resolve` reads. On the CPU it runs synchronously, through the same code."""
        if step.logprob_rows:
            raise ValueError("launch: a request wants prompt logprobs; run() the step instead")
        fb = self._build_forward_batch(step, prev_ids=prev.next_ids if prev is not None else None)
        hidden, rows = self._forward_eager(fb, step.sample_rows)
        if step.sample_rows:
            logits = self.model.compute_logits(hidden[rows])  # (S, V)
            next_ids = self._sample_on_device(logits, step.sampling, all(r.plain_greedy() for r in step.sampling))
        else:  # every request is a chunk mid-way (or prefill-only): nothing to read back
            next_ids = torch.empty(0, dtype=torch.int64, device=hidden.device)
        host, event = self._copy_to_host(next_ids, "prefill")
        return PendingPrefill(next_ids, host, event, step.sampling_reqs, step.batch_size)

    def resolve(self, pending) -> StepOutput:
        """Wait for a launched step (`PendingDecode` or `PendingPrefill`) and read its tokens."""
        if pending.event is not None:
            pending.event.synchronize()
        ids = pending.host.tolist()
        if isinstance(pending, PendingPrefill):
            n = pending.batch_size
            per_req: list[Optional[int]] = [None] * n  # None: a chunk mid-way or prefill-only
            for tok, i in zip(ids, pending.sampling_reqs):
                per_req[i] = tok
            return StepOutput(next_token_ids=per_req, output_logprobs=[None] * n, input_logprobs=[[] for _ in range(n)])
        # A decode step computes no prompt logprobs: input_logprobs stays empty (read for EXTEND only).
        return StepOutput(next_token_ids=ids, output_logprobs=[None] * len(ids))

    def _sample_on_device(
        self, logits: torch.Tensor, rows: list[SamplingRow], plain_greedy: bool, greedy: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """(B,) int64 next ids of logits (B, V), without reading anything back (no grammar here)."""
        if plain_greedy:
            return greedy if greedy is not None else greedy_tokens(logits)
        info = SamplingBatchInfo.from_rows(rows, logits.shape[1], logits.device)
        apply_logit_adjustments(logits, rows, info)
        return sample(logits, rows, info)

    def _copy_to_host(self, ids: torch.Tensor, ring: str):
        """A pinned host copy of the (n,) sampled ids, queued after the step, and the event marking it
        done; on the CPU the ids themselves and no event (nothing runs asynchronously)."""
        if self.device != "cuda":
            return ids, None
        host = self._next_host_buffer(ring, ids.shape[0])
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _next_host_buffer(self, ring: str, n: int) -> torch.Tensor:
        # NOTE: two pinned buffers per kind of step, used in turn: at most two steps of a kind are in
        # flight (the one being read back and the one just launched), and a prefill and a decode step
        # never share a buffer, whatever order the scheduler launches them in.
        bufs = self._host_rings.get(ring)
        if bufs is None:
            size = self.max_running_requests + 1
            bufs = self._host_rings[ring] = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        pos = self._ring_pos[ring] = self._ring_pos[ring] ^ 1
        return bufs[pos][:n]

    def _upload(self, rows) -> torch.Tensor:
        """k equally long int lists (or a (k, n) array) → a (k, n) int64 device tensor, one copy."""
        host = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        if self.device == "cpu":
            return host
        k, n = host.shape
        # NOTE: rows padded to an even length, so every row of the result starts 16-byte aligned. Triton
        # compiles a kernel variant per pointer alignment: with odd n (a batch of one request: rows 8
        # bytes apart) a prefill would need variants that the start-up warm-up did not compile.
        width = n + (n & 1)
        # NOTE: a ring of pinned staging buffers, each reused only after its last copy completed: with
        # overlap scheduling the next step's inputs are written while this step's copy may be pending.
        slot = self._staging_pos = (self._staging_pos + 1) % len(self._staging)
        buf, done = self._staging[slot]
        if done is not None:
            done.synchronize()
        if buf is None or buf.numel() < k * width:
            buf = torch.empty(max(k * width, 1 << 16), dtype=torch.int64, pin_memory=True)
        staging = buf[: k * width].view(k, width)
        staging[:, :n].copy_(host)
        dev = staging.to(self.device, non_blocking=True)[:, :n]
        done = torch.cuda.Event()
        done.record()
        self._staging[slot] = (buf, done)
        return dev

    def _build_forward_batch(self, step: StepInput, prev_ids: Optional[torch.Tensor] = None) -> ForwardBatch:
        """`prev_ids`: the sampled ids of the step in flight, some of which are this step's input ids
        (`step.prev_src`)."""
        if step.mode.is_decode():
            rows = step.token_rows if step.prev_src is None else np.vstack([step.token_rows, step.prev_src])
            dev = self._upload(rows)  # (5 or 6, B)
            input_ids, pos_t, pool_t, seq_t, loc_t = dev[:5]
            token_rows = pool_t
        else:
            rows = step.token_rows if step.prev_src is None else np.vstack([step.token_rows, step.prev_src])
            uploaded = dev = self._upload(rows)  # (4, T); VERIFY (5, T): + req_to_token positions; + prev_src
            input_ids, pos_t, loc_t, token_rows = uploaded[:4]
            pool_t, seq_t, pre_t, ext_t, start_t = self._upload(step.req_rows)  # (5, B)
        if step.prev_src is not None:
            input_ids = _ids_from_prev(input_ids, prev_ids, dev[-1], step.all_ids_from_prev)
        table_pos = uploaded[4] if step.mode.is_verify() else pos_t
        # The new tokens' kv slots go into req_to_token here: one indexed write on the device, and the
        # same values from the host rows into its host mirror.
        self.req_to_token_pool.write_step((token_rows, table_pos, loc_t), step.kv_writes)
        fb = ForwardBatch(
            forward_mode=step.mode,
            batch_size=step.batch_size,
            input_ids=input_ids,
            positions=pos_t,
            req_pool_indices=pool_t,
            seq_lens=seq_t,
            out_cache_loc=loc_t,
            seq_lens_cpu=step.seq_lens,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        if step.mode.is_decode():
            fb.req_pool_indices_cpu = step.token_rows[2]  # (B,) host rows, for the shared-prefix grouping
        else:
            fb.extend_prefix_lens_cpu = list(step.prefix_lens)
            fb.extend_seq_lens_cpu = list(step.extend_lens)
            fb.decode_rows = step.decode_rows
            fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc = pre_t, ext_t, start_t
        if step.mode.is_verify():
            set_verify_tree(fb, step, self.device)
        return fb

    def _sample(self, step: StepInput, hidden, logits=None, greedy=None, sample_rows_t=None) -> StepOutput:
        n = step.batch_size
        out = StepOutput(next_token_ids=[None] * n, output_logprobs=[None] * n, input_logprobs=[[] for _ in range(n)])
        if step.logprob_rows:
            self._prompt_logprobs(step, hidden, out)
        if not step.sample_rows:
            return out
        rows = step.sampling
        if logits is None:
            logits = self.model.compute_logits(hidden[sample_rows_t])  # (S, V); rows uploaded by run()
        want_lp = [r.return_logprob for r in rows]
        raw_logits = logits.clone() if any(want_lp) else None
        if all(r.plain_greedy() for r in rows):
            # NOTE: the common case pays for no sampling tensors (each is a host-to-device copy).
            next_ids = greedy if greedy is not None else greedy_tokens(logits)
        else:
            info = SamplingBatchInfo.from_rows(rows, logits.shape[1], logits.device)
            apply_logit_adjustments(logits, rows, info)
            if info.has_grammar:
                self._grammar_masker().apply(logits, [r.grammar for r in rows])
            next_ids = sample(logits, rows, info)
        if raw_logits is not None:
            top_k = max(r.top_logprobs_num for r in rows)
            chosen, top_v, top_i = compute_logprobs(raw_logits, next_ids, top_k)
            chosen = chosen.tolist()
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
        next_list = next_ids.tolist()
        for j, i in enumerate(step.sampling_reqs):
            out.next_token_ids[i] = next_list[j]
            if raw_logits is not None and want_lp[j]:
                k = rows[j].top_logprobs_num
                top = list(zip(top_v[j][:k], top_i[j][:k])) if (k and top_v is not None) else None
                out.output_logprobs[i] = (chosen[j], top)
        return out

    def _prompt_logprobs(self, step: StepInput, hidden: torch.Tensor, out: StepOutput) -> None:
        lp_rows = step.logprob_rows
        rows = torch.tensor([lr.row for lr in lp_rows], dtype=torch.int64, device=hidden.device)
        # (a next-token row has no target: 0 stands in, its logprob is not reported)
        targets = torch.tensor([lr.target for lr in lp_rows], dtype=torch.int64, device=hidden.device)
        top_k = max(lr.top_k for lr in lp_rows)
        chosen, top_v, top_i = compute_logprobs(self.model.compute_logits(hidden[rows]), targets, top_k)
        chosen = chosen.tolist()
        top_v = top_v.tolist() if top_v is not None else None
        top_i = top_i.tolist() if top_i is not None else None
        for j, lr in enumerate(lp_rows):
            top = list(zip(top_v[j][: lr.top_k], top_i[j][: lr.top_k])) if (lr.top_k and top_v is not None) else None
            if lr.next_token:
                out.output_logprobs[lr.req] = (None, top)  # the next token's distribution, no token
            else:
                out.input_logprobs[lr.req].append((lr.pos, chosen[j], lr.target, top))

    def _grammar_masker(self):
        if self._masker is None:
            from ..constrained.masker import GrammarMasker

            self._masker = GrammarMasker(self.vocab_size)
        return self._masker


def _ids_from_prev(host_ids: torch.Tensor, prev_ids: torch.Tensor, src: torch.Tensor, every: bool) -> torch.Tensor:
    """(T,) input ids: host_ids, where `src` (T,) >= 0 the previous step's sampled id at that index instead
    (`every`: all of them, no host id is read)."""
    if every:
        return prev_ids.index_select(0, src)
    return torch.where(src >= 0, prev_ids.index_select(0, src.clamp(min=0)), host_ids)


def default_max_running_requests(device: str, max_total_tokens: int) -> int:
    """CPU: 256 (a step's cost grows with the batch: larger batches only add latency). GPU: 1,024, so a
    decode step's matmuls run at a batch where the tensor cores are busy, but no more requests than
    the KV pool holds at 128 tokens each (a small pool would otherwise retract all the time); the
    per-request table rows cost (context_len + 8) * 4 bytes each on the device and on the host."""
    if device != "cuda":
        return CPU_DEFAULT_RUNNING_REQUESTS
    return max(1, min(GPU_MAX_AUTO_RUNNING_REQUESTS, max_total_tokens // 128))
