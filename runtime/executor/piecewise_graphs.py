"""CUDA graphs of a step's layers between its attention kernels ("piecewise"), for the steps the decode
graphs do not hold: EXTEND steps (a mixed step's decode rows with prefill chunks, a small prefill) and
decode batches past the largest decode graph.

A decode graph holds a whole step, its attention included: a decode step's attention has one shape per
batch size. An extend step's attention depends on how its tokens split into requests and how long each
one's prefix is, so its graphs hold everything else. For a step of T tokens, padded to a captured size:
piece 0 embeds the tokens and runs layer 0 up to its attention kernel (norm, QKV projection, rotary, the
K/V store; `DecoderLayer.attention_input`), piece i (1..L-1) runs layer i-1 after its attention (O
projection, norms, MLP; `attention_output`) and layer i up to its attention, and piece L the last layer's
rest and the final norm. The attention kernels run eagerly between the pieces, over the step's real rows,
from the queries the piece before left in its static output into the buffer the next piece reads. An
eager 8B step launches ~400 kernels from Python, which at a mixed step's size takes the host about as long
as the device takes to run them; as L + 1 graph launches and the attention's few kernels per layer, the
host stays ahead (benchmarks/RESULTS.md, issue 32).

Padding rows (T..size): token 0 at position 0, K/V into the dummy slot 0; their attention output is
whatever the buffer held (rows never mix outside attention, which reads the real rows only).

Memory: one graph pool for every piece of every size, captured largest size first; each piece's outputs
stay referenced (they are the next piece's inputs), so no later capture reuses them, and a size's pieces
are replayed in the order they were captured.

On the CPU (tests) the pieces run eagerly over the same buffers (`capture=False`): the same arithmetic,
padding and hand-offs, without graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..forward_batch import ForwardBatch, ForwardMemory, ForwardMode
from ..models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The token counts graphs are captured for, up to `max_tokens` (at least 16): fine steps where a mixed
    step's decode rows and a short chunk fall, coarser above. Each size keeps its own per-layer hand-off
    tensors (~0.4 MB a token at the 8B shape), so the grid above 640 tokens is coarse: a padded row costs
    less there than the memory of a size per 64 tokens."""
    sizes = [16] + list(range(32, 257, 32)) + list(range(320, 641, 64)) + list(range(768, 8193, 128))
    return [s for s in sizes if s <= max(max_tokens, 16)]


# The share of the device memory still free after the KV pool that the piecewise graphs' hand-off tensors may
# take: the rest is for a large prefill chunk's activations (an 8,192-token chunk of the 8B shape: ~2 GB).
MEMORY_SHARE = 0.5


def affordable_max_tokens(max_tokens: int, bytes_per_token: int, free_bytes: int) -> int:
    """The largest captured size up to `max_tokens` whose sizes' hand-off tensors (every size up to it, at
    `bytes_per_token`) fit in MEMORY_SHARE of `free_bytes`; 0 when not even the smallest does. On an 80 GB
    GPU the 8B shape's default (1024) fits many times over; a 24 GB GPU left with ~3 GB after an 8B model's
    KV pool gets fewer sizes instead of an out-of-memory error at start-up."""
    best, used = 0, 0
    for size in piecewise_sizes(max_tokens):
        used += size * bytes_per_token
        if used > MEMORY_SHARE * free_bytes:
            break
        best = size
    return best


@dataclass
class _Pieces:
    """One captured size: its L + 1 graphs and the static tensors they hand each other."""

    size: int
    graphs: list = field(default_factory=list)  # torch.cuda.CUDAGraph each; empty when not captured
    queries: list = field(default_factory=list)  # per layer: (size, H, D), what its attention reads
    residuals: list = field(default_factory=list)  # per layer: (size, hidden), the residual stream
    hidden: Optional[torch.Tensor] = None  # (size, hidden): the final norm's output


class PiecewiseGraphs:
    def __init__(self, model: LlamaForCausalLM, memory: ForwardMemory, max_tokens: int, capture: bool = True):
        self.model = model
        self.memory = memory
        self.sizes = piecewise_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        dev = memory.kv_pool.device
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        attn = model.layers[0].self_attn
        dtype = model.layers[0].input_layernorm.weight.dtype
        # The attention's output, which every piece after the first reads (one buffer: the pieces run in turn).
        self.attn_out = torch.zeros(n, attn.num_heads * attn.head_dim, dtype=dtype, device=dev)  # (n, H * D)
        self.pieces: dict[int, _Pieces] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.replays = 0
        if capture:
            self._capture_all()
        else:
            self.pieces = {s: self._run_pieces(s, None) for s in self.sizes}

    @staticmethod
    def bytes_per_token(model: LlamaForCausalLM) -> int:
        """Device bytes one captured token costs: each layer's queries and residual stream kept for the graphs'
        hand-offs, and the final states (the graph pool's other activations are reused between pieces)."""
        attn, dtype = model.layers[0].self_attn, model.layers[0].input_layernorm.weight.dtype
        hidden = model.config.hidden_size
        per_layer = attn.num_heads * attn.head_dim + hidden
        return (len(model.layers) * per_layer + hidden) * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Whether the model's steps can run as pieces: one device holds it whole (a split model's
        all-reduces and stage hand-offs stay eager), with layers of the one kind the pieces know."""
        parallel = model.parallel
        return (
            parallel.tp.size == 1
            and parallel.stage.is_first
            and parallel.stage.is_last
            and model.embed_tokens is not None
            and len(model.layers) > 0
        )

    def can_run(self, fb: ForwardBatch) -> bool:
        """An EXTEND or DECODE step of at most `max_tokens` tokens without what only the eager forward does:
        LoRA adapters, image tokens, a drafter's captured layers."""
        return (
            (fb.forward_mode == ForwardMode.EXTEND or fb.forward_mode.is_decode())
            and fb.input_ids.shape[0] <= self.max_tokens
            and fb.lora is None
            and not fb.images
            and not fb.capture_layers
        )

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on `fb` (its attention metadata built): (T, hidden) final states, a view of a static
        buffer that the next run overwrites."""
        t = fb.input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, t)]
        if size != t:  # padding rows: token 0 at position 0, K/V into the dummy slot
            self.input_ids[t:size].zero_()
            self.positions[t:size].zero_()
            self.out_cache_loc[t:size].zero_()
        self.input_ids[:t].copy_(fb.input_ids, non_blocking=True)
        self.positions[:t].copy_(fb.positions, non_blocking=True)
        self.out_cache_loc[:t].copy_(fb.out_cache_loc, non_blocking=True)
        pieces = self.pieces[size]
        layers = self.model.layers
        for i, layer in enumerate(layers):
            if pieces.graphs:
                pieces.graphs[i].replay()
            else:
                self._piece(i, size, pieces)
            q = pieces.queries[i][:t]  # (t, H, D)
            o = fb.attn_backend.forward(q, None, None, layer.self_attn.spec, fb, kv_stored=True)  # (t, H * D)
            self.attn_out[:t].copy_(o)
        if pieces.graphs:
            pieces.graphs[len(layers)].replay()
        else:
            self._piece(len(layers), size, pieces)
        self.replays += 1
        assert pieces.hidden is not None
        return pieces.hidden[:t]

    # ---- the pieces ----
    def _static_batch(self, size: int) -> ForwardBatch:
        """What the pieces read of a step: the pool and where this step's K/V go (the attention runs outside)."""
        mem = self.memory
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            req_pool_indices=self.input_ids[:1],
            seq_lens=self.input_ids[:1],
            out_cache_loc=self.out_cache_loc[:size],
            seq_lens_cpu=[size],
            req_to_token_pool=mem.req_to_token_pool,
            kv_pool=mem.kv_pool,
            attn_backend=mem.attn_backend,
        )

    def _piece(self, i: int, size: int, pieces: _Pieces) -> None:
        """Piece i of a size: layer i-1 after its attention (none for i = 0: the embedding), then layer i
        up to its attention (for i = L: the final norm). Writes its outputs into `pieces` the first time
        (the static tensors the graph keeps), and in place after."""
        layers, fb = self.model.layers, self._static_batch(size)
        positions = self.positions[:size]
        if i == 0:
            h, residual = self.model.embed_tokens(self.input_ids[:size]), None  # (size, hidden)
        else:
            h, residual = layers[i - 1].attention_output(self.attn_out[:size], pieces.residuals[i - 1])
        if i == len(layers):
            pieces.hidden = _kept(pieces.hidden, self.model.norm(h, residual)[0])  # (size, hidden)
            return
        q, residual = layers[i].attention_input(positions, h, residual, fb)  # (size, H, D), (size, hidden)
        if len(pieces.queries) == i:
            pieces.queries.append(None)
            pieces.residuals.append(None)
        pieces.queries[i] = _kept(pieces.queries[i], q)
        pieces.residuals[i] = _kept(pieces.residuals[i], residual)

    def _run_pieces(self, size: int, capture: Optional[Callable[[int, _Pieces], None]]) -> _Pieces:
        pieces = _Pieces(size)
        for i in range(len(self.model.layers) + 1):
            if capture is None:
                self._piece(i, size, pieces)
            else:
                capture(i, pieces)
        return pieces

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first: later captures fit in the memory it freed
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                warm = self._run_pieces(size, None)  # lazy inits and kernel compiles, outside the graphs
            torch.cuda.current_stream().wait_stream(stream)
            del warm

            def capture(i: int, pieces: _Pieces, size: int = size) -> None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self._piece(i, size, pieces)
                if self.pool is None:
                    self.pool = graph.pool()
                pieces.graphs.append(graph)

            self.pieces[size] = self._run_pieces(size, capture)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured piecewise CUDA graphs for %d token counts (%d..%d), %d layers each, in %.1f s; device "
            "memory reserved +%.0f MiB",
            len(self.sizes),
            self.sizes[0],
            self.max_tokens,
            len(self.model.layers),
            self.capture_seconds,
            (torch.cuda.memory_reserved() - reserved) / 2**20,
        )


def _kept(static: Optional[torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    """A piece's output: kept the first time (a graph's static tensor), copied into it after if a later
    eager run made a new one (the CPU's path; a graph replay writes in place)."""
    if static is None:
        return tensor
    if tensor.data_ptr() != static.data_ptr():
        static.copy_(tensor)
    return static
