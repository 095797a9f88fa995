"""ModelRunner: owns the model, the KV memory and the attention backend; runs one step.

`__init__` reads as a recipe: resolve device/dtype → build model and load weights → size the KV pool
→ build the attention backend (→ capture CUDA graphs, on GPU). `run(batch)` turns a ScheduleBatch into
a ForwardBatch, runs the model, computes the logits rows that are needed, and samples.
`launch_decode` / `launch_prefill` do the same without waiting for the device (overlap scheduling):
the sampled ids stay on the device with a pinned host copy that `resolve` reads later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..attention import create_attention_backend
from ..forward_batch import ForwardBatch
from ..kvcache.memory_pool import KVPool, ReqToTokenPool, TokenAllocator
from ..models.config import ModelConfig
from .loader import load_model, load_model_config
from .sampler import SamplingBatchInfo, apply_logit_adjustments, compute_logprobs, greedy_tokens, sample
from ..request import Req
from ..scheduler.batch import ScheduleBatch
from ..server_args import ServerArgs

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


@dataclass
class StepOutput:
    # Per request in batch order: the sampled token, or None (chunk mid-way / prefill-only).
    next_token_ids: list[Optional[int]]
    # Per request: (logprob, top list or None) for the sampled token, when asked.
    output_logprobs: list = field(default_factory=list)
    # Per request: list of (prompt position, logprob, token id, top list or None) computed this step.
    input_logprobs: list = field(default_factory=list)


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_path: str, grammar_hook=None):
        self.server_args = server_args
        self.device = server_args.resolved_device()
        self.grammar_hook = grammar_hook
        if self.device == "cuda":
            torch.cuda.set_device(0)
        torch.manual_seed(server_args.random_seed)

        self.model_config: ModelConfig = load_model_config(model_path, server_args.load_format)
        cfg = self.model_config
        self.dtype = server_args.resolved_dtype(cfg.checkpoint_dtype)
        self.context_len = cfg.resolve_context_length(server_args.context_length)
        self.model = load_model(model_path, cfg, server_args.load_format, self.dtype, self.device,
                                self.context_len, server_args.random_seed)
        self.vocab_size = cfg.vocab_size

        self.max_total_tokens = self._size_kv_pool()
        self.max_running_requests = server_args.max_running_requests or default_max_running_requests(
            self.device, self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len + 8, self.device)
        self.kv_pool = KVPool(self.max_total_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads,
                              cfg.head_dim, self.dtype, self.device)
        self.allocator = TokenAllocator(self.max_total_tokens, self.device)
        self.attn_backend = create_attention_backend(server_args.resolved_attention_backend(), self)
        self._staging = [(None, None)] * 4  # pinned host buffers for per-step inputs (GPU) + their copy events
        self._staging_pos = 0
        # Pinned buffers receiving the sampled tokens of overlapped steps: one pair for decode steps, one
        # for prefill steps (a prefill may be launched while the last decode step's copy is unread).
        self._host_rings: dict[str, list[torch.Tensor]] = {}
        self._ring_pos: dict[str, int] = {"decode": 0, "prefill": 0}
        self.graph_runner = None
        if self.device == "cuda" and not server_args.disable_cuda_graph and self.attn_backend.supports_cuda_graph:
            from .cuda_graphs import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self)

    def _size_kv_pool(self) -> int:
        cfg, sa = self.model_config, self.server_args
        if sa.max_total_tokens is not None:
            return sa.max_total_tokens
        per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.dtype)
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            used = total - free
            budget = total * sa.mem_fraction_static - used
            if budget <= 0:
                raise RuntimeError(f"no GPU memory left for the KV cache (mem_fraction_static={sa.mem_fraction_static})")
            return int(min(budget // per_token, GPU_MAX_AUTO_KV_TOKENS))
        return CPU_DEFAULT_KV_TOKENS

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, batch: ScheduleBatch) -> StepOutput:
        fb, sample_rows, sampling_reqs, input_lp_rows = self._build_forward_batch(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            # Decode: the graph computes the logits of every row too (one row per request), and their argmax.
            logits, greedy = self.graph_runner.replay(fb)  # (B, vocab) float32, (B,)
            return self._sample(batch, None, sample_rows, sampling_reqs, input_lp_rows, logits, greedy)
        hidden, rows = self._forward_eager(fb, sample_rows)
        return self._sample(batch, hidden, sample_rows, sampling_reqs, input_lp_rows, sample_rows_t=rows)

    def _forward_eager(self, fb: ForwardBatch, sample_rows: list[int]):
        """The model on `fb` without a graph: (T, hidden) states and the (S,) device rows to sample."""
        self.attn_backend.init_forward_metadata(fb)
        # NOTE: the rows to sample are uploaded before the forward is queued: an upload from a Python list
        # after it waits for the whole forward (a pageable copy syncs the stream), and only then could
        # the LM head and the sampling be queued.
        rows = self._upload([sample_rows])[0] if sample_rows else None
        return self.model(fb.input_ids, fb.positions, fb), rows  # (T, hidden), (S,)

    # ------------------------------------------------------------------ overlapped decode
    @torch.inference_mode()
    def launch_decode(self, batch: ScheduleBatch, prev: Optional["PendingDecode"] = None) -> "PendingDecode":
        """Start a decode step without waiting for it (overlap scheduling).

        With `prev` (the step still in flight), the input tokens are prev's sampled tokens, read on the
        device, and each request is one token further along than its CPU-side state says. prev's
        requests may be a superset of the batch's (some finished meanwhile): `batch.prev_rows` names the
        rows of prev that go on, gathered in `_build_forward_batch`. Only for requests `can_overlap`
        accepts (no logprobs, grammar or penalties: those need the previous token on the host).
        """
        fb, _, _, _ = self._build_forward_batch(batch, ahead=1 if prev is not None else 0,
                                                input_ids=prev.next_ids if prev is not None else None)
        greedy = None
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            logits, greedy = self.graph_runner.replay(fb)
        else:
            self.attn_backend.init_forward_metadata(fb)
            logits = self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))
        reqs = batch.reqs
        plain_greedy = prev.plain_greedy if prev is not None else all(_plain_greedy(r) for r in reqs)
        next_ids = self._sample_on_device(logits, reqs, plain_greedy, greedy)
        host, event = self._copy_to_host(next_ids, "decode")
        return PendingDecode(next_ids, host, event, plain_greedy)

    # ------------------------------------------------------------------ overlapped prefill
    @torch.inference_mode()
    def launch_prefill(self, batch: ScheduleBatch) -> PendingPrefill:
        """Start a prefill (EXTEND) step without waiting for it (overlap scheduling): the sampled tokens
        stay on the device, with a pinned host copy that `resolve` reads. Only for requests
        `can_overlap` accepts (no logprobs, so no prompt logprobs either; no grammar or penalties: the
        sampling needs nothing from the host). On the CPU it runs synchronously, through the same code.
        """
        fb, sample_rows, sampling_reqs, input_lp_rows = self._build_forward_batch(batch)
        if input_lp_rows:
            raise ValueError("launch_prefill: a request wants prompt logprobs; run() the batch instead")
        hidden, rows = self._forward_eager(fb, sample_rows)
        if sample_rows:
            s_reqs = [batch.reqs[i] for i in sampling_reqs]
            logits = self.model.compute_logits(hidden[rows])  # (S, V)
            next_ids = self._sample_on_device(logits, s_reqs, all(_plain_greedy(r) for r in s_reqs))  # (S,)
        else:  # every request is a chunk mid-way (or prefill-only): nothing to read back
            next_ids = torch.empty(0, dtype=torch.int64, device=hidden.device)
        host, event = self._copy_to_host(next_ids, "prefill")
        return PendingPrefill(next_ids, host, event, sampling_reqs, len(batch.reqs))

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

    def _sample_on_device(self, logits: torch.Tensor, reqs: list[Req], plain_greedy: bool,
                          greedy: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B,) int64 next ids of logits (B, V), without reading anything back (no grammar here)."""
        if plain_greedy:
            return greedy if greedy is not None else greedy_tokens(logits)
        info = SamplingBatchInfo.from_reqs(reqs, logits.shape[1], logits.device)
        apply_logit_adjustments(logits, reqs, info)
        return sample(logits, reqs, info)

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

    @staticmethod
    def can_overlap(r: Req) -> bool:
        sp = r.sampling_params
        return (not r.return_logprob and r.grammar is None and sp.frequency_penalty == 0
                and sp.presence_penalty == 0 and sp.repetition_penalty == 1.0
                and len(r.output_ids) >= sp.min_new_tokens)

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
        staging = buf[:k * width].view(k, width)
        staging[:, :n].copy_(host)
        dev = staging.to(self.device, non_blocking=True)[:, :n]
        done = torch.cuda.Event()
        done.record()
        self._staging[slot] = (buf, done)
        return dev

    def _build_forward_batch(self, batch: ScheduleBatch, ahead: int = 0, input_ids: Optional[torch.Tensor] = None):
        reqs = batch.reqs
        sample_rows: list[int] = []  # row in hidden (T,) per sampling request
        sampling_reqs: list[int] = []  # index into batch.reqs
        # (req index, row, prompt position of the predicted token; the prompt's length: the next token)
        input_lp_rows: list[tuple[int, int, int]] = []
        if batch.mode.is_decode():
            # NOTE: numpy rows, not per-request lists: a pipelined step reuses the previous step's lengths.
            rows = batch.decode_host_rows(ahead, with_input_ids=input_ids is None)  # (5 or 6, B)
            dev = self._upload(rows)
            ids_t, pos_t, pool_t, seq_t, loc_t = dev[:5]
            if input_ids is None:
                input_ids = ids_t
            elif batch.prev_rows is not None:  # the previous step's samples of the requests that go on
                input_ids = input_ids.index_select(0, dev[5])
            token_rows = pool_t
            seq_lens = batch.seq_lens_host.tolist()
            sample_rows = list(range(len(reqs)))
            sampling_reqs = sample_rows
        else:
            token_host, req_host = batch.extend_host_rows()  # (4, T), (5, B)
            seq_lens = req_host[1].tolist()
            offset = 0
            for i, (r, pre, ext) in enumerate(zip(reqs, batch.prefix_lens, batch.extend_lens)):
                if pre + ext == r.seq_len and not r.prefill_only:
                    sample_rows.append(offset + ext - 1)
                    sampling_reqs.append(i)
                if r.needs_input_logprobs():
                    prompt_len = len(r.origin_input_ids)
                    first = max(r.logprob_start_len, 1, pre + 1, r.input_logprob_next)
                    # NOTE: a chunk's last row predicts the next chunk's first prompt token: computed
                    # here, since the next chunk has no row before it (it was lost at every boundary).
                    for pos in range(first, min(pre + ext + 1, prompt_len)):
                        input_lp_rows.append((i, offset + (pos - 1 - pre), pos))
                if pre + ext == r.seq_len and r.prefill_only and r.return_logprob and r.top_logprobs_num:
                    # max_new_tokens=0 with top logprobs: no token, but the next token's distribution (the
                    # "position" past the prompt; SGLang programs read it, e.g. to branch on the top-k).
                    input_lp_rows.append((i, offset + ext - 1, len(r.origin_input_ids)))
                offset += ext
            input_ids, pos_t, loc_t, token_rows = self._upload(token_host)  # (4, T)
            pool_t, seq_t, pre_t, ext_t, start_t = self._upload(req_host)  # (5, B)
        # The new tokens' kv slots go into req_to_token here: one indexed write on the device, and the
        # same values from the host rows into its host mirror.
        self.req_to_token_pool.write_step((token_rows, pos_t, loc_t), batch.kv_writes)
        fb = ForwardBatch(
            forward_mode=batch.mode, batch_size=len(reqs), input_ids=input_ids, positions=pos_t,
            req_pool_indices=pool_t, seq_lens=seq_t, out_cache_loc=loc_t, seq_lens_cpu=seq_lens,
            req_to_token_pool=self.req_to_token_pool, kv_pool=self.kv_pool, attn_backend=self.attn_backend)
        if batch.mode.is_decode():
            fb.req_pool_indices_cpu = rows[2]  # (B,) host rows, for the shared-prefix grouping
        if batch.mode.is_extend():
            fb.extend_prefix_lens_cpu = list(batch.prefix_lens)
            fb.extend_seq_lens_cpu = list(batch.extend_lens)
            fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc = pre_t, ext_t, start_t
        return fb, sample_rows, sampling_reqs, input_lp_rows

    def _sample(self, batch, hidden, sample_rows, sampling_reqs, input_lp_rows, logits=None,
                greedy=None, sample_rows_t=None) -> StepOutput:
        reqs = batch.reqs
        out = StepOutput(next_token_ids=[None] * len(reqs), output_logprobs=[None] * len(reqs),
                         input_logprobs=[[] for _ in reqs])
        if input_lp_rows:
            rows = torch.tensor([row for _, row, _ in input_lp_rows], dtype=torch.int64, device=hidden.device)
            # (a next-token row has no target: 0 stands in, its logprob is not reported)
            targets = torch.tensor([_prompt_token(reqs[i], pos) for i, _, pos in input_lp_rows],
                                   dtype=torch.int64, device=hidden.device)
            top_k = max(reqs[i].top_logprobs_num for i, _, _ in input_lp_rows)
            chosen, top_v, top_i = compute_logprobs(self.model.compute_logits(hidden[rows]), targets, top_k)
            chosen = chosen.tolist()
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
            for j, (i, _, pos) in enumerate(input_lp_rows):
                k = reqs[i].top_logprobs_num
                top = list(zip(top_v[j][:k], top_i[j][:k])) if (k and top_v is not None) else None
                if pos == len(reqs[i].origin_input_ids):
                    out.output_logprobs[i] = (None, top)  # the next token's distribution, no token
                else:
                    out.input_logprobs[i].append((pos, chosen[j], int(targets[j]), top))
        if not sample_rows:
            return out
        s_reqs = [reqs[i] for i in sampling_reqs]
        if logits is None:
            logits = self.model.compute_logits(hidden[sample_rows_t])  # (B, V); rows uploaded by run()
        want_lp = [r.return_logprob for r in s_reqs]
        raw_logits = logits.clone() if any(want_lp) else None
        if all(_plain_greedy(r) for r in s_reqs):
            # NOTE: the common case pays for no sampling tensors (each is a host-to-device copy).
            next_ids = greedy if greedy is not None else greedy_tokens(logits)
        else:
            info = SamplingBatchInfo.from_reqs(s_reqs, logits.shape[1], logits.device)
            apply_logit_adjustments(logits, s_reqs, info)
            if info.has_grammar and self.grammar_hook is not None:
                self.grammar_hook(logits, s_reqs)
            next_ids = sample(logits, s_reqs, info)
        if raw_logits is not None:
            top_k = max(r.top_logprobs_num for r in s_reqs)
            chosen, top_v, top_i = compute_logprobs(raw_logits, next_ids, top_k)
            chosen = chosen.tolist()
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
        next_list = next_ids.tolist()
        for j, i in enumerate(sampling_reqs):
            out.next_token_ids[i] = next_list[j]
            if raw_logits is not None and want_lp[j]:
                k = reqs[i].top_logprobs_num
                top = list(zip(top_v[j][:k], top_i[j][:k])) if (k and top_v is not None) else None
                out.output_logprobs[i] = (chosen[j], top)
        return out


def default_max_running_requests(device: str, max_total_tokens: int) -> int:
    """CPU: 256 (a step's cost grows with the batch: larger batches only add latency). GPU: 1,024, so a
    decode step's matmuls run at a batch where the tensor cores are busy, but no more requests than
    the KV pool holds at 128 tokens each (a small pool would otherwise retract all the time); the
    per-request table rows cost (context_len + 8) * 4 bytes each on the device and on the host."""
    if device != "cuda":
        return CPU_DEFAULT_RUNNING_REQUESTS
    return max(1, min(GPU_MAX_AUTO_RUNNING_REQUESTS, max_total_tokens // 128))


def _prompt_token(r: Req, pos: int) -> int:
    return r.origin_input_ids[pos] if pos < len(r.origin_input_ids) else 0


def _plain_greedy(r: Req) -> bool:
    sp = r.sampling_params
    return (sp.is_greedy and r.grammar is None and not sp.logit_bias and sp.frequency_penalty == 0
            and sp.presence_penalty == 0 and sp.repetition_penalty == 1.0
            and len(r.output_ids) >= sp.min_new_tokens)
