"""ModelRunner: owns the model, the KV memory and the attention backend; runs one step.

`__init__` reads as a recipe: resolve device/dtype → build model and load weights → size the KV pool
→ build the attention backend (→ capture CUDA graphs, on GPU). `run(batch)` turns a ScheduleBatch into
a ForwardBatch, runs the model, computes the logits rows that are needed, and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .attention import create_attention_backend
from .forward_batch import ForwardBatch, ForwardMode
from .memory_pool import KVPool, ReqToTokenPool, TokenAllocator
from .model_config import ModelConfig
from .model_loader import load_model, load_model_config
from .sampler import SamplingBatchInfo, apply_logit_adjustments, compute_logprobs, sample
from .schedule_batch import Req, ScheduleBatch
from .server_args import ServerArgs

logger = logging.getLogger(__name__)

# Default KV capacity on the CPU, in tokens, when max_total_tokens is not given.
CPU_DEFAULT_KV_TOKENS = 65536


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
        self.dtype = server_args.resolved_dtype()
        self.grammar_hook = grammar_hook
        if self.device == "cuda":
            torch.cuda.set_device(0)
        torch.manual_seed(server_args.random_seed)

        self.model_config: ModelConfig = load_model_config(model_path, server_args.load_format)
        cfg = self.model_config
        self.context_len = min(server_args.context_length or cfg.max_position_embeddings,
                               cfg.max_position_embeddings)
        self.model = load_model(model_path, cfg, server_args.load_format, self.dtype, self.device,
                                self.context_len, server_args.random_seed)
        self.vocab_size = cfg.vocab_size

        self.max_total_tokens = self._size_kv_pool()
        self.max_running_requests = server_args.max_running_requests
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len + 8, self.device)
        self.kv_pool = KVPool(self.max_total_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads,
                              cfg.head_dim, self.dtype, self.device)
        self.allocator = TokenAllocator(self.max_total_tokens, self.device)
        self.attn_backend = create_attention_backend(server_args.resolved_attention_backend(), self)
        self.graph_runner = None
        if self.device == "cuda" and not server_args.disable_cuda_graph and self.attn_backend.supports_cuda_graph:
            from .cuda_graph_runner import CudaGraphRunner

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
            return int(budget // per_token)
        return CPU_DEFAULT_KV_TOKENS

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, batch: ScheduleBatch) -> StepOutput:
        fb, sample_rows, sampling_reqs, input_lp_rows = self._build_forward_batch(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            hidden = self.graph_runner.replay(fb)
        else:
            self.attn_backend.init_forward_metadata(fb)
            hidden = self.model(fb.input_ids, fb.positions, fb)  # (T, hidden)
        return self._sample(batch, hidden, sample_rows, sampling_reqs, input_lp_rows)

    def _build_forward_batch(self, batch: ScheduleBatch):
        dev = self.device
        reqs = batch.reqs
        sample_rows: list[int] = []  # row in hidden (T,) per sampling request
        sampling_reqs: list[int] = []  # index into batch.reqs
        input_lp_rows: list[tuple[int, int, int]] = []  # (req index, row, prompt position of the predicted token)
        if batch.mode.is_decode():
            ids = [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in reqs]
            seq_lens = [r.seq_len for r in reqs]
            positions = [s - 1 for s in seq_lens]
            sample_rows = list(range(len(reqs)))
            sampling_reqs = list(range(len(reqs)))
        else:
            ids, positions, seq_lens = [], [], []
            offset = 0
            for i, (r, pre, ext) in enumerate(zip(reqs, batch.prefix_lens, batch.extend_lens)):
                fill = r.fill_ids
                ids.extend(fill[pre:pre + ext])
                positions.extend(range(pre, pre + ext))
                seq_lens.append(pre + ext)
                if pre + ext == len(fill) and not r.prefill_only:
                    sample_rows.append(offset + ext - 1)
                    sampling_reqs.append(i)
                if r.needs_input_logprobs():
                    prompt_len = len(r.origin_input_ids)
                    first = max(r.logprob_start_len, 1, pre + 1, r.input_logprob_next)
                    for pos in range(first, min(pre + ext, prompt_len)):
                        input_lp_rows.append((i, offset + (pos - 1 - pre), pos))
                offset += ext
        fb = ForwardBatch(
            forward_mode=batch.mode,
            batch_size=len(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            out_cache_loc=batch.out_cache_loc.to(dev),
            seq_lens_cpu=seq_lens,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        if batch.mode.is_extend():
            fb.extend_prefix_lens_cpu = list(batch.prefix_lens)
            fb.extend_seq_lens_cpu = list(batch.extend_lens)
            fb.extend_prefix_lens = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=dev)
            fb.extend_seq_lens = torch.tensor(batch.extend_lens, dtype=torch.int64, device=dev)
            starts = [0]
            for e in batch.extend_lens[:-1]:
                starts.append(starts[-1] + e)
            fb.extend_start_loc = torch.tensor(starts, dtype=torch.int64, device=dev)
        return fb, sample_rows, sampling_reqs, input_lp_rows

    def _sample(self, batch, hidden, sample_rows, sampling_reqs, input_lp_rows) -> StepOutput:
        reqs = batch.reqs
        out = StepOutput(next_token_ids=[None] * len(reqs), output_logprobs=[None] * len(reqs),
                         input_logprobs=[[] for _ in reqs])
        if input_lp_rows:
            rows = torch.tensor([row for _, row, _ in input_lp_rows], dtype=torch.int64, device=hidden.device)
            targets = torch.tensor([reqs[i].origin_input_ids[pos] for i, _, pos in input_lp_rows],
                                   dtype=torch.int64, device=hidden.device)
            top_k = max(reqs[i].top_logprobs_num for i, _, _ in input_lp_rows)
            chosen, top_v, top_i = compute_logprobs(self.model.compute_logits(hidden[rows]), targets, top_k)
            chosen = chosen.tolist()
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
            for j, (i, _, pos) in enumerate(input_lp_rows):
                k = reqs[i].top_logprobs_num
                top = list(zip(top_v[j][:k], top_i[j][:k])) if (k and top_v is not None) else None
                out.input_logprobs[i].append((pos, chosen[j], int(targets[j]), top))
        if not sample_rows:
            return out
        s_reqs = [reqs[i] for i in sampling_reqs]
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])  # (B, V)
        want_lp = [r.return_logprob for r in s_reqs]
        raw_logits = logits.clone() if any(want_lp) else None
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
