"""CUDA graphs for decode steps.

Graphs are captured at start-up for bucketed batch sizes up to `cuda_graph_max_bs`, over static
input buffers. A decode batch of n requests replays the smallest bucket >= n: the real rows are
copied into the static buffers and the padding rows write their K/V to the dummy slot 0. The
attention backend prepares its own static metadata through its capture/replay hooks. The graph
ends with the logits and their argmax (greedy tokens), so a replay is the whole forward of a decode
step and a greedy batch needs no launch after it. Batches larger than the biggest bucket run eagerly.

Variants: a backend may capture more graphs per batch size. A cascade one (hooks `has_cascade_graph(bs)`
and `decode_uses_cascade(fb)`; the triton backend's shared-prefix kernels, batch >= 16, with their
tables filled from the host rows in `req_pool_indices_cpu` at each replay): a step replays it only when
the backend says its batch shares a prefix (with nothing grouped the cascade kernels cost more:
RESULTS.md). A ragged one (`has_ragged_graph(bs)`, `decode_uses_ragged(fb)`; the triton backend's
split-KV decode from a per-step split plan, which a long request among short ones needs): a step replays
it when the backend says its lengths are that far apart. Every other step replays the plain graph.

Memory: every graph writes its logits into the first bs rows of ONE (max_bs, vocab) float32 buffer,
allocated outside the graph pool. A graph output allocated inside the pool would stay alive, so each
graph would keep its own (bs, vocab) logits (gigabytes summed over the buckets up to 1,024 at a 128k
vocabulary); this way all a graph keeps is its (bs,) greedy ids, and its temporaries (the bf16 matmul
output among them) return to the shared pool for the next capture. Largest first, so later captures
fit into the memory the first one freed. A replay's outputs are valid until the next replay of any
graph (stream order covers everything enqueued before it, as with one graph).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..forward_batch import ForwardBatch, ForwardMemory, ForwardMode
from ..kernel_choices import current as current_kernels
from ..kernel_choices import using as using_kernels
from ..lora.matmul import LoraBatch
from ..lora.slots import LoraSlots
from ..models.llama import LlamaForCausalLM
from .sampler import greedy_tokens

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_bs] or [1]


@dataclass(frozen=True)
class GraphKey:
    batch_size: int
    cascade: bool  # captured with the backend's shared-prefix kernels
    ragged: bool = False  # captured for steps whose requests' lengths are far apart


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        memory: ForwardMemory,
        vocab_size: int,
        max_bs: int,
        lora: Optional[LoraSlots] = None,
    ):
        """Captures the graphs of `model` over `memory`, for decode batches of up to `max_bs` requests;
        with `lora`, each row's LoRA adapter is applied too, its slot read from a static buffer (slot 0,
        the base model, adds zeros), so one graph serves any mix of adapters."""
        self.model = model
        self.memory = memory
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev = memory.kv_pool.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.lora = lora
        self.lora_slots = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)  # each row's adapter slot
        self.logits = torch.empty(self.max_bs, vocab_size, dtype=torch.float32, device=dev)  # every graph's
        backend = memory.attn_backend
        backend.init_cuda_graph_state(self.max_bs)
        self.cascade_sizes = frozenset(bs for bs in self.batch_sizes if backend.has_cascade_graph(bs))
        self.ragged_sizes = frozenset(bs for bs in self.batch_sizes if backend.has_ragged_graph(bs))
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.greedy: dict[GraphKey, torch.Tensor] = {}  # (bs,) int64 greedy ids, each graph's own
        # Each graph's static batch, kept while the graph lives: the captured kernels read tensors its parts
        # own, made outside the graph's memory pool (the LoRA per-token segments), which must not be freed.
        self.static_batches: dict[GraphKey, ForwardBatch] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.plain_replays = 0
        self.cascade_replays = 0
        self.ragged_replays = 0  # of the plain replays, those of the ragged variant
        self._capture_all()

    def _static_batch(self, bs: int) -> ForwardBatch:
        mem = self.memory
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=[1] * bs,
            req_to_token_pool=mem.req_to_token_pool,
            kv_pool=mem.kv_pool,
            attn_backend=mem.attn_backend,
        )
        if self.lora is not None:
            fb.lora = LoraBatch(self.lora, self.lora_slots[:bs])  # gathered per row: slots are data
        return fb

    def graph_keys(self) -> list[GraphKey]:
        """Every graph to capture, largest batch first (later captures reuse the memory it freed)."""
        keys = []
        for bs in reversed(self.batch_sizes):
            keys.append(GraphKey(bs, False))
            if bs in self.ragged_sizes:
                keys.append(GraphKey(bs, False, ragged=True))
            if bs in self.cascade_sizes:
                keys.append(GraphKey(bs, True))
        return keys

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        self.seq_lens.fill_(1)
        for key in self.graph_keys():
            self._capture(key, stream)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        cascade, ragged = sorted(self.cascade_sizes), sorted(self.ragged_sizes)
        logger.info(
            "captured %d decode CUDA graphs in %.1f s: %d plain (batch %s), %d ragged (batch %s), %d with "
            "cascade attention (batch %s); logits buffer %.0f MiB, device memory reserved +%.0f MiB",
            len(self.graphs),
            self.capture_seconds,
            len(self.batch_sizes),
            _span(self.batch_sizes),
            len(ragged),
            _span(ragged),
            len(cascade),
            _span(cascade),
            self.logits.numel() * 4 / 2**20,
            (torch.cuda.memory_reserved() - reserved) / 2**20,
        )

    def _capture(self, key: GraphKey, stream: torch.cuda.Stream) -> None:
        with using_kernels(current_kernels().for_rows(key.batch_size)):  # (e.g. PDL for one FP8 row)
            self._capture_with(key, stream)

    def _capture_with(self, key: GraphKey, stream: torch.cuda.Stream) -> None:
        fb = self._static_batch(key.batch_size)
        self._init_metadata(fb, key, capture=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (lazy inits, autotuning) outside the graph
                self._forward(fb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            greedy = self._forward(fb)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        self.greedy[key] = greedy
        self.static_batches[key] = fb

    def _init_metadata(self, fb: ForwardBatch, key: GraphKey, capture: bool) -> None:
        backend = self.memory.attn_backend
        hook = (
            backend.init_forward_metadata_capture_cuda_graph
            if capture
            else backend.init_forward_metadata_replay_cuda_graph
        )
        variant = {}  # several variants of this batch size: say which one
        if fb.batch_size in self.cascade_sizes:
            variant["cascade"] = key.cascade
        if fb.batch_size in self.ragged_sizes:
            variant["ragged"] = key.ragged
        hook(fb, **variant)

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        logits = self.logits[: fb.batch_size]  # (bs, vocab) float32: the first rows of the shared buffer
        # NOTE: forward_logits, not forward + compute_logits: at batch 1 the final norm then runs inside
        # the LM head's matmul (one launch fewer per step, when the one-row path is on).
        self.model.forward_logits(fb.input_ids, fb.positions, fb, out=logits)
        return greedy_tokens(logits)  # (bs,)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the captured step for fb's requests: (logits (n, vocab), greedy token ids (n,)), views of
        static buffers that the next replay overwrites."""
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
        if self.lora is not None:
            if fb.lora is None:
                self.lora_slots[:bs].zero_()
            else:
                self.lora_slots[n:bs].zero_()
                self.lora_slots[:n].copy_(fb.lora.token_slots, non_blocking=True)
        static = self._static_batch(bs)
        # Host lengths of the padded batch: backends that plan on the host (flashinfer) need them, and
        # reading them back from the device would cost a sync per step.
        static.seq_lens_cpu = list(fb.seq_lens_cpu) + [0] * (bs - n)
        static.req_pool_indices_cpu = fb.req_pool_indices_cpu  # the n real rows (shared-prefix grouping)
        backend = self.memory.attn_backend
        cascade = bs in self.cascade_sizes and backend.decode_uses_cascade(static)
        key = GraphKey(bs, cascade, not cascade and bs in self.ragged_sizes and backend.decode_uses_ragged(static))
        self._init_metadata(static, key, capture=False)
        self.graphs[key].replay()
        if key.cascade:
            self.cascade_replays += 1
        else:
            self.plain_replays += 1
            self.ragged_replays += key.ragged
        return self.logits[:n], self.greedy[key][:n]


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if sizes else "none"
