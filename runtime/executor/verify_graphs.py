"""CUDA graphs for VERIFY steps (speculative decoding), GPU only.

A verify step of B requests with at most `nodes` tree nodes each (speculative_num_draft_tokens) replays
the graph of the smallest captured batch >= B, over static buffers laid out `nodes` rows per request:
request b's real nodes at rows b * nodes ..., then dead nodes (token 0, K/V into the dummy slot 0,
seeing only their request's root, their table positions pointing at slot 0), then padding requests
(no new tokens: the tree kernel skips them). The graph is the target's forward and its logits for every
row (and the hidden states, and the layers a drafter reads); `replay` gathers the real rows back into
the step's own layout, so the verifier and the drafters read it as they read an eager step.

The attention backend builds a verify step's metadata from the forward batch's tensors only (the triton
backend: `_verify_metadata`, with a tree mask always given), so static tensors make it graph-safe.
Not run in this repository's CPU test suite (tests/test_spec_gpu.py, marked gpu).
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from ..forward_batch import ForwardBatch, ForwardMode
from ..step import StepInput

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


class VerifyGraphRunner:
    def __init__(self, mr, nodes: int, max_bs: int, capture_layers: tuple = ()):
        self.mr = mr
        self.nodes = nodes
        self.capture_layers = capture_layers
        self.batch_sizes = [s for s in BATCH_SIZES if s <= max_bs] or [1]
        self.max_bs = self.batch_sizes[-1]
        T, B, dev = self.max_bs * nodes, self.max_bs, mr.device
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.out_loc = torch.zeros(T, dtype=torch.int64, device=dev)
        self.req_rows = torch.zeros(B, dtype=torch.int64, device=dev)
        self.prefix = torch.zeros(B, dtype=torch.int64, device=dev)
        self.ext = torch.zeros(B, dtype=torch.int64, device=dev)
        self.mask = torch.zeros(B * nodes * nodes, dtype=torch.uint8, device=dev)
        self.starts = torch.arange(B, device=dev) * nodes
        self.tree_lens = torch.full((B,), nodes, dtype=torch.int64, device=dev)
        self.offsets = torch.arange(B, device=dev) * nodes * nodes
        self.logits = torch.empty(T, mr.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.captured: dict[int, list] = {}
        self.pool = None
        start = time.perf_counter()
        self._capture_all()
        logger.info("captured %d verify CUDA graphs (%d tokens per request, batch %s) in %.1f s", len(self.graphs),
                    nodes, self.batch_sizes, time.perf_counter() - start)

    def _static_batch(self, bs: int) -> ForwardBatch:
        mr, n = self.mr, self.nodes
        fb = ForwardBatch(forward_mode=ForwardMode.VERIFY, batch_size=bs, input_ids=self.input_ids[:bs * n],
                          positions=self.positions[:bs * n], req_pool_indices=self.req_rows[:bs],
                          seq_lens=self.prefix[:bs] + n, out_cache_loc=self.out_loc[:bs * n],
                          seq_lens_cpu=[n] * bs, req_to_token_pool=mr.req_to_token_pool, kv_pool=mr.kv_pool,
                          attn_backend=mr.attn_backend)
        fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc = self.prefix[:bs], self.ext[:bs], self.starts[:bs]
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = [0] * bs, [n] * bs
        fb.tree_lens, fb.tree_lens_cpu = self.tree_lens[:bs], [n] * bs
        fb.tree_mask, fb.tree_mask_offsets = self.mask[:bs * n * n], self.offsets[:bs]
        if self.capture_layers:
            fb.capture_layers = self.capture_layers
        return fb

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream()
        self.ext.fill_(self.nodes)
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs)
            self.mr.attn_backend.init_forward_metadata(fb)  # static tensors only: valid for every replay
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(fb, bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.hidden[bs], self.captured[bs] = self._forward(fb, bs)
            self.pool = self.pool or graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _forward(self, fb: ForwardBatch, bs: int):
        fb.captured_hidden = [] if self.capture_layers else None
        hidden = self.mr.model(fb.input_ids, fb.positions, fb)  # (bs * nodes, hidden)
        self.mr.model.compute_logits(hidden, out=self.logits[:bs * self.nodes])
        return hidden, fb.captured_hidden

    def can_run(self, step: StepInput) -> bool:
        return step.batch_size <= self.max_bs and max(step.extend_lens) <= self.nodes

    def replay(self, step: StepInput):
        """(logits (T, V), hidden (T, hidden), captured layers) in the step's own row order."""
        n, B = self.nodes, step.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, B)]
        sizes = np.asarray(step.extend_lens, dtype=np.int64)
        starts = step.req_rows[4]
        ids = np.zeros(bs * n, dtype=np.int64)
        pos = np.zeros(bs * n, dtype=np.int64)
        loc = np.zeros(bs * n, dtype=np.int64)
        mask = np.zeros((bs, n, n), dtype=np.uint8)
        gather = np.empty(step.num_tokens, dtype=np.int64)  # step row -> graph row
        dead_rows, dead_cols = [], []
        for b in range(B):
            s, k, g = int(starts[b]), int(sizes[b]), b * n
            ids[g:g + k], pos[g:g + k], loc[g:g + k] = step.token_rows[0, s:s + k], step.token_rows[1, s:s + k], \
                step.token_rows[2, s:s + k]
            pos[g + k:g + n] = step.prefix_lens[b] + 1
            gather[s:s + k] = np.arange(g, g + k)
            block = _tree_block(step, b, k)
            mask[b, :k, :k] = block
            mask[b, k:, 0] = 1  # dead nodes see their root and themselves
            mask[b, np.arange(k, n), np.arange(k, n)] = 1
            dead_rows.extend([int(step.req_rows[0, b])] * (n - k))
            dead_cols.extend(range(step.prefix_lens[b] + k, step.prefix_lens[b] + n))
        mr = self.mr
        # The real nodes' slots into the table (device and host), the dead ones' columns to slot 0 (device).
        rows_t, cols_t, slots_t = (torch.from_numpy(a).to(mr.device, non_blocking=True) for a in step.kv_writes)
        mr.req_to_token_pool.write_step((rows_t, cols_t, slots_t), step.kv_writes)
        if dead_rows:
            dr = torch.tensor(dead_rows, device=mr.device)
            mr.req_to_token_pool.req_to_token[dr, torch.tensor(dead_cols, device=mr.device)] = 0
        req = np.zeros((3, bs), dtype=np.int64)
        req[0, :B] = step.req_rows[0]
        req[1, :B] = step.prefix_lens
        req[2, :B] = n
        host = np.concatenate([ids, pos, loc, req.reshape(-1)])
        dev = torch.from_numpy(host).to(mr.device, non_blocking=True)
        T = bs * n
        self.input_ids[:T].copy_(dev[:T])
        self.positions[:T].copy_(dev[T:2 * T])
        self.out_loc[:T].copy_(dev[2 * T:3 * T])
        self.req_rows[:bs].copy_(dev[3 * T:3 * T + bs])
        self.prefix[:bs].copy_(dev[3 * T + bs:3 * T + 2 * bs])
        self.ext[:bs].copy_(dev[3 * T + 2 * bs:3 * T + 3 * bs])
        self.mask[:T * n].copy_(torch.from_numpy(mask.reshape(-1)).to(mr.device, non_blocking=True))
        self.graphs[bs].replay()
        at = torch.from_numpy(gather).to(mr.device, non_blocking=True)
        captured = [c.index_select(0, at) for c in self.captured[bs]] if self.captured[bs] else None
        return self.logits.index_select(0, at), self.hidden[bs].index_select(0, at), captured


def _tree_block(step: StepInput, b: int, k: int) -> np.ndarray:
    """(k, k) ancestor mask of request b's tree (a chain's: lower triangular)."""
    mask = step.draft.tree_mask
    if mask is None:
        return np.tril(np.ones((k, k), dtype=np.uint8))
    sizes = np.asarray(step.extend_lens, dtype=np.int64)
    off = int((sizes[:b] * sizes[:b]).sum())
    return mask[off:off + k * k].reshape(k, k).astype(np.uint8)
