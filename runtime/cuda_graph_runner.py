"""CUDA graphs for decode steps.

Graphs are captured at start-up for bucketed batch sizes up to `cuda_graph_max_bs`, over static
input buffers. A decode batch of n requests replays the smallest bucket >= n: the real rows are
copied into the static buffers and the padding rows write their K/V to the dummy slot 0. The
attention backend prepares its own static metadata through its capture/replay hooks (the triton
backend's graphs of batch >= 16 also carry its shared-prefix tables, which it fills from the host rows
in `req_pool_indices_cpu` at each replay). The graph
ends with the logits and their argmax (greedy tokens), so a replay is the whole forward of a decode
step and a greedy batch needs no launch after it. Batches larger
than the biggest bucket run eagerly.
"""

from __future__ import annotations

import bisect
import logging

import torch

from .forward_batch import ForwardBatch, ForwardMode
from .sampler import greedy_tokens

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_bs] or [1]


class CudaGraphRunner:
    def __init__(self, model_runner):
        self.mr = model_runner
        mr = model_runner
        max_bs = min(mr.server_args.cuda_graph_max_bs or mr.max_running_requests, mr.max_running_requests)
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev = mr.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        mr.attn_backend.init_cuda_graph_state(self.max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bs -> (logits, greedy ids)
        self.pool = None
        self._capture_all()

    def _static_batch(self, bs: int) -> ForwardBatch:
        mr = self.mr
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[:bs], seq_lens_cpu=[1] * bs,
            req_to_token_pool=mr.req_to_token_pool, kv_pool=mr.kv_pool, attn_backend=mr.attn_backend)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream()
        self.seq_lens.fill_(1)
        for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its memory pool
            fb = self._static_batch(bs)
            self.mr.attn_backend.init_forward_metadata_capture_cuda_graph(fb)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (lazy inits, autotuning) outside the graph
                    self._forward(fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._forward(fb)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: forward_logits, not forward + compute_logits: at batch 1 the final norm then runs inside
        # the LM head's matmul (one launch fewer per step).
        logits = self.mr.model.forward_logits(fb.input_ids, fb.positions, fb)  # (bs, vocab) float32
        return logits, greedy_tokens(logits)  # (bs, vocab), (bs,)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the captured step for fb's requests: (logits (n, vocab), greedy token ids (n,))."""
        n = fb.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        if bs != n:  # padding rows: token 0 at position 0, K/V into the dummy slot, no keys read
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_cache_loc[n:bs].zero_()
            self.req_pool_indices[n:bs].zero_()
            self.seq_lens[n:bs].zero_()
        self.input_ids[:n].copy_(fb.input_ids, non_blocking=True)
        self.positions[:n].copy_(fb.positions, non_blocking=True)
        self.req_pool_indices[:n].copy_(fb.req_pool_indices, non_blocking=True)
        self.seq_lens[:n].copy_(fb.seq_lens, non_blocking=True)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc, non_blocking=True)
        static = self._static_batch(bs)
        # Host lengths of the padded batch: backends that plan on the host (flashinfer) need them, and
        # reading them back from the device would cost a sync per step.
        static.seq_lens_cpu = list(fb.seq_lens_cpu) + [0] * (bs - n)
        static.req_pool_indices_cpu = fb.req_pool_indices_cpu  # the n real rows (shared-prefix grouping)
        self.mr.attn_backend.init_forward_metadata_replay_cuda_graph(static)
        self.graphs[bs].replay()
        logits, greedy = self.outputs[bs]
        return logits[:n], greedy[:n]
