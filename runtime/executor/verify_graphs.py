"""CUDA graphs for VERIFY steps (speculative decoding), GPU only.

A verify step of T tokens (B requests, at most `nodes` tree nodes each: speculative_num_draft_tokens)
replays the graph of the smallest captured token count T_cap >= T. The step's rows are the graph's first
T rows, in the step's own order (no gather afterwards); the T_cap - T rows after them are dead: token 0
at position 0, K/V into the dummy slot 0, one more request of their own (prefix 0, each node seeing the
first and itself, over table columns of the first request's row: finite values, read only) so no row's attention
is left unwritten. Request slots past that have no new tokens: the tree kernel skips them. A graph of
T_cap tokens has min(T_cap, max_bs + 1) request slots (a step has at most one request per token, and the
dead rows need one).

Graphs by token count, not by batch x nodes: a step pays for the rows it has (a batch whose requests
mostly have no drafts is few rows), not for `nodes` rows per request (8B at batch 32: 256 rows are
compute-bound, 64 are not).

The graph is the target's forward and its logits for every row (and the hidden states, and the layers a
drafter reads). The attention backend builds a verify step's metadata from the forward batch's tensors
only (the triton backend: `_verify_metadata`, with a tree mask always given), so static tensors make it
graph-safe. Every per-step input goes up in one copy from a pinned buffer. With LoRA adapters each row's
adapter slot is one more per-token input (the gathered LoraBatch: slot 0, the base model and the dead rows,
adds zeros), so one graph serves any mix of adapters. Not run in this repository's CPU test suite
(tests/spec/test_spec_gpu.py, marked gpu).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Optional

import numpy as np
import torch

from ..forward_batch import ForwardBatch, ForwardMemory, ForwardMode
from ..lora.matmul import LoraBatch
from ..lora.slots import LoraSlots
from ..models.llama import LlamaForCausalLM
from ..step import StepInput

logger = logging.getLogger(__name__)

# Int64 inputs, in this order in one buffer: per token (T_max each), then per request slot (B_max each);
# with LoRA adapters, each token's adapter slot after the token fields.
TOKEN_FIELDS = ("ids", "pos", "loc", "table_rows", "table_cols")
LORA_FIELD = "lora"
REQUEST_FIELDS = ("rows", "prefix", "ext", "starts", "tree_lens", "offsets", "seq")


def token_buckets(t_max: int) -> list[int]:
    """Captured token counts: every count up to 8, then four per doubling, and t_max itself."""
    out, t = list(range(1, min(8, t_max) + 1)), 8
    while t < t_max:
        t = min(t_max, t + t // 4)
        out.append(t)
    return out


class VerifyGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        memory: ForwardMemory,
        vocab_size: int,
        nodes: int,
        max_bs: int,
        capture_layers: tuple = (),
        lora: Optional[LoraSlots] = None,
    ):
        self.model = model
        self.lora = lora
        self.memory = memory
        self.nodes = nodes
        self.capture_layers = capture_layers
        self.max_bs = max(1, max_bs)
        # NOTE: dead rows read table columns up to t_max of a request's row: no more than the table holds.
        self.t_max = min(self.max_bs * nodes, memory.req_to_token_pool.max_context_len)
        self.token_counts = token_buckets(self.t_max)
        T, B, dev = self.t_max, self.max_bs + 1, memory.kv_pool.device
        token_fields = TOKEN_FIELDS + ((LORA_FIELD,) if lora is not None else ())
        self._layout = {f: (i * T, T) for i, f in enumerate(token_fields)}
        base = len(token_fields) * T
        self._layout.update({f: (base + i * B, B) for i, f in enumerate(REQUEST_FIELDS)})
        size = base + len(REQUEST_FIELDS) * B
        self.args = torch.zeros(size, dtype=torch.int64, device=dev)  # every per-step input
        self.host_args = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host_args.numpy()
        mask_bytes = self.max_bs * nodes * nodes + T * T  # the real trees' masks, then the dead rows'
        self.mask = torch.zeros(mask_bytes, dtype=torch.uint8, device=dev)
        self.host_mask = torch.zeros(mask_bytes, dtype=torch.uint8, pin_memory=True)
        self.host_mask_np = self.host_mask.numpy()
        self._uploaded = None  # the event after the last upload (the pinned buffers are reused after it)
        # Dead node e sees column 0 and its own (column 0 in every program's first key tile: a row that
        # saw no key of a tile yet would turn NaN), over a dead request's prefix of 0.
        self._dead_mask = np.eye(T, dtype=np.uint8)
        self._dead_mask[:, 0] = 1
        self._tril = [np.tril(np.ones((k, k), dtype=np.uint8)).reshape(-1) for k in range(nodes + 1)]
        self.logits = torch.empty(T, vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.captured: dict[int, list] = {}
        # Each graph's static batch, kept while the graph lives: the captured kernels read tensors its parts
        # own, made outside the graph's memory pool (the LoRA per-token segments: freed, their memory went to
        # other tensors, and a replay read adapter slots and token offsets out of range).
        self.static_batches: dict[int, ForwardBatch] = {}
        self.pool = None
        start = time.perf_counter()
        self._capture_all()
        logger.info(
            "captured %d verify CUDA graphs (up to %d tokens per request, %d tokens) in %.1f s",
            len(self.graphs),
            nodes,
            T,
            time.perf_counter() - start,
        )

    def _view(self, field: str, n: int) -> torch.Tensor:
        at, _ = self._layout[field]
        return self.args[at : at + n]

    def _host(self, field: str) -> np.ndarray:
        at, n = self._layout[field]
        return self.host_np[at : at + n]

    @staticmethod
    def request_slots(tokens: int, max_bs: int) -> int:
        return min(tokens, max_bs + 1)

    def _static_batch(self, t_cap: int) -> ForwardBatch:
        mem, v = self.memory, self._view
        bs = self.request_slots(t_cap, self.max_bs)
        fb = ForwardBatch(
            forward_mode=ForwardMode.VERIFY,
            batch_size=bs,
            input_ids=v("ids", t_cap),
            positions=v("pos", t_cap),
            req_pool_indices=v("rows", bs),
            seq_lens=v("seq", bs),
            out_cache_loc=v("loc", t_cap),
            seq_lens_cpu=[t_cap] * bs,
            req_to_token_pool=mem.req_to_token_pool,
            kv_pool=mem.kv_pool,
            attn_backend=mem.attn_backend,
        )
        fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc = v("prefix", bs), v("ext", bs), v("starts", bs)
        # NOTE: t_cap new tokens per request as far as the kernels' grids go: the dead rows' request may
        # have up to t_cap - 1 of them.
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = [0] * bs, [t_cap] * bs
        fb.tree_lens, fb.tree_lens_cpu = v("tree_lens", bs), [t_cap] * bs
        fb.tree_mask, fb.tree_mask_offsets = self.mask, v("offsets", bs)
        if self.capture_layers:
            fb.capture_layers = self.capture_layers
        if self.lora is not None:
            fb.lora = LoraBatch(self.lora, v(LORA_FIELD, t_cap))  # gathered per token: the slots are data
        return fb

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream()
        for t_cap in reversed(self.token_counts):
            self._fill_capture_inputs(t_cap)
            fb = self._static_batch(t_cap)
            self.memory.attn_backend.init_forward_metadata(fb)  # static tensors only: valid for every replay
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(fb, t_cap)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.hidden[t_cap], self.captured[t_cap] = self._forward(fb, t_cap)
            self.pool = self.pool or graph.pool()
            self.graphs[t_cap] = graph
            self.static_batches[t_cap] = fb
        torch.cuda.synchronize()

    def _fill_capture_inputs(self, t_cap: int) -> None:
        """Capture-time inputs: every row a dead node of one request (table row 0), as replays' dead rows."""
        self._wait_upload()
        self.host_np[:] = 0
        for f in ("ext", "tree_lens", "seq"):
            self._host(f)[0] = t_cap
        self.host_mask_np[: t_cap * t_cap] = self._dead_mask[:t_cap, :t_cap].reshape(-1)
        self._upload(t_cap * t_cap)

    def _wait_upload(self) -> None:
        """Before the pinned buffers are written: the last upload from them has finished."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def _upload(self, mask_bytes: int) -> None:
        """The pinned inputs to their device buffers, one copy each."""
        self.args.copy_(self.host_args, non_blocking=True)
        self.mask[:mask_bytes].copy_(self.host_mask[:mask_bytes], non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()

    def _forward(self, fb: ForwardBatch, t_cap: int):
        fb.captured_hidden = [] if self.capture_layers else None
        hidden = self.model(fb.input_ids, fb.positions, fb)  # (t_cap, hidden)
        self.model.compute_logits(hidden, out=self.logits[:t_cap])
        return hidden, fb.captured_hidden

    def can_run(self, step: StepInput) -> bool:
        return step.batch_size <= self.max_bs and step.num_tokens <= self.t_max and max(step.extend_lens) <= self.nodes

    def replay(self, step: StepInput):
        """(logits (T, V), hidden (T, hidden), captured layers) of the step's rows, in its own order
        (views of the graph's outputs: valid until the next replay)."""
        T, B = step.num_tokens, step.batch_size
        t_cap = self.token_counts[bisect.bisect_left(self.token_counts, T)]
        dead = t_cap - T
        self._wait_upload()
        h = self._host
        sizes = np.asarray(step.extend_lens, dtype=np.int64)  # (B,)
        squares = sizes * sizes
        for f, row in (("ids", 0), ("pos", 1), ("loc", 2), ("table_rows", 3), ("table_cols", 4)):
            a = h(f)
            a[:T] = step.token_rows[row]
            a[T:t_cap] = 0
        if self.lora is not None:
            a = h(LORA_FIELD)
            a[:T] = np.repeat(step.lora.slots, sizes) if step.lora is not None else 0  # (T,) each node's adapter
            a[T:t_cap] = 0
        slots = self.request_slots(t_cap, self.max_bs)
        for f in REQUEST_FIELDS:
            h(f)[:slots] = 0
        h("rows")[:B] = step.req_rows[0]
        h("prefix")[:B] = step.prefix_lens
        h("ext")[:B] = sizes
        h("tree_lens")[:B] = sizes
        h("starts")[:B] = step.req_rows[4]
        h("offsets")[:B] = np.cumsum(squares) - squares
        real_mask = int(squares.sum())
        mask = step.draft.tree_mask
        self.host_mask_np[:real_mask] = mask if mask is not None else np.concatenate([self._tril[k] for k in sizes])
        if dead:  # the dead rows' request: each sees its first node and itself
            h("rows")[B] = step.req_rows[0, 0]
            h("ext")[B] = h("tree_lens")[B] = dead
            h("starts")[B] = T
            h("offsets")[B] = real_mask
            self.host_mask_np[real_mask : real_mask + dead * dead] = self._dead_mask[:dead, :dead].reshape(-1)
        h("seq")[:slots] = h("prefix")[:slots] + h("ext")[:slots]
        self._upload(real_mask + dead * dead)
        # The real nodes' slots into the table (device, and host mirror).
        v = self._view
        self.memory.req_to_token_pool.write_step((v("table_rows", T), v("table_cols", T), v("loc", T)), step.kv_writes)
        self.graphs[t_cap].replay()
        captured = [c[:T] for c in self.captured[t_cap]] if self.captured[t_cap] else None
        return self.logits[:T], self.hidden[t_cap][:T], captured
