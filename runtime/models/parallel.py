"""How a model is split over ranks: tensor parallelism (each layer's heads and MLP columns, and the
vocabulary, over a group of ranks) and pipeline stages (contiguous layers per rank).

The model files build their layers at the local sizes given here and call `tp.all_reduce` after each
row-parallel matmul. One rank alone (`ModelParallel.single()`) makes every call an identity, so the
single-device model is unchanged.

Tensor-parallel sharding (Megatron's):
- q/k/v and gate/up are column-parallel (each rank its heads, its slice of the intermediate dimension),
  still fused into one matmul each on the rank;
- o_proj and down_proj are row-parallel (each rank its input slice), then an all-reduce; a bias is
  added by rank 0 alone (the sum then holds it once);
- KV heads are sharded like the query heads when there are at least as many as ranks, else replicated:
  each rank holds the one KV head its query heads read (tp_size must then be a multiple of them);
- the embedding and the LM head are vocabulary-parallel (rows [start, start + shard) per rank, the
  last shard padded with zero rows): the embedding sums the ranks' lookups (an all-reduce), the LM
  head gathers the ranks' logits side by side.

Pipeline stages: stage s runs layers [first, first + count); the first stage also holds the embedding
and the LM head (the last stage sends its normed hidden states back to it: the sampler lives there),
the last stage the final norm.

Checkpoint reads (`checkpoint_read`): each rank reads only its slices of a safetensors file
(safetensors' `get_slice`), never the whole tensor, and nothing of another stage's layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (`group`: a torch.distributed process group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group (in place; x itself when alone)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, local: torch.Tensor, width: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(N, W) column block per rank -> (N, width): the ranks' blocks side by side (rank order), cut
        to `width` (the padding of the last block dropped); written into `out` when given."""
        if self.size == 1:
            return local if out is None else out.copy_(local)
        import torch.distributed as dist

        n, w = local.shape
        blocks = torch.empty(self.size * n, w, dtype=local.dtype, device=local.device)  # (tp * N, W)
        # NOTE: all_gather_single is the newer name (torch >= 2.12) of all_gather_into_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(blocks, local.contiguous(), group=self.group)
        full = blocks.view(self.size, n, w).permute(1, 0, 2).reshape(n, self.size * w)[:, :width]  # (N, width)
        return full.contiguous() if out is None else out.copy_(full)


ONE_RANK = TensorParallel()  # a model on one rank: every call an identity


@dataclass(frozen=True)
class PipelineStage:
    """This rank's pipeline stage: layers [first_layer, first_layer + num_layers) of `total_layers`."""

    rank: int = 0
    size: int = 1
    first_layer: int = 0
    num_layers: int = -1  # -1: every layer (one stage)
    total_layers: int = -1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def of(cls, rank: int, size: int, total_layers: int) -> "PipelineStage":
        """Stage `rank` of `size` over `total_layers` layers, split as evenly as they go (the later
        stages take the remainder: the first one also holds the embedding and the LM head)."""
        base, extra = divmod(total_layers, size)
        counts = [base + (1 if s >= size - extra else 0) for s in range(size)]
        return cls(rank, size, sum(counts[:rank]), counts[rank], total_layers)

    def layer_count(self, total: int) -> int:
        return total if self.num_layers < 0 else self.num_layers

    def local_layer(self, global_layer: int) -> Optional[int]:
        """The local index of a global layer, None when another stage holds it."""
        if self.num_layers < 0:
            return global_layer
        local = global_layer - self.first_layer
        return local if 0 <= local < self.num_layers else None


@dataclass(frozen=True)
class ModelParallel:
    """Where one rank sits in a model split over ranks: its tensor-parallel group and pipeline stage,
    its global rank, the group of every rank of the model (`world`, for start-up agreements), and its
    device (cuda:`device_index` on a GPU)."""

    tp: TensorParallel = field(default_factory=TensorParallel)
    stage: PipelineStage = field(default_factory=PipelineStage)
    rank: int = 0
    world: Any = None
    device_index: int = 0

    @classmethod
    def single(cls) -> "ModelParallel":
        return cls()

    @property
    def is_single(self) -> bool:
        return self.tp.size == 1 and self.stage.size == 1

    @property
    def records_table_writes(self) -> bool:
        """Rank 0 of a split model: the scheduler's req_to_token writes are shipped to the other ranks."""
        return self.rank == 0 and not self.is_single

    def agree_min(self, value: int) -> int:
        """The smallest `value` over every rank (the KV pool's size: each rank sizes it from its own free
        memory, and every rank must hold every slot rank 0 hands out)."""
        if self.is_single:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.world)
        return int(t.item())


# ---------------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class HeadShard:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    first_head: int  # the rank's first query head (global index)
    first_kv_head: int  # its first KV head (global index)


def check_parallel_shape(cfg: ModelConfig, tp_size: int, pp_size: int = 1) -> None:
    """Raise ValueError naming the numbers unless `cfg` splits over tp_size ranks and pp_size stages."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp_size:
        raise ValueError(
            f"tp_size {tp_size} does not divide the model's num_attention_heads {heads} "
            f"({cfg.architecture}): use a tp_size that does ({_divisors(heads)})"
        )
    if kv >= tp_size and kv % tp_size:
        raise ValueError(
            f"tp_size {tp_size} does not divide the model's num_key_value_heads {kv}: use a tp_size "
            f"that divides {kv}, or a multiple of it that divides {heads} (KV heads replicated)"
        )
    if kv < tp_size and tp_size % kv:
        raise ValueError(
            f"tp_size {tp_size} is above the model's num_key_value_heads {kv} and not a multiple of it "
            f"(each KV head must be replicated on the same number of ranks)"
        )
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the model's intermediate_size {cfg.intermediate_size}")
    if pp_size > cfg.num_hidden_layers:
        raise ValueError(
            f"pp_size {pp_size} is above the model's num_hidden_layers {cfg.num_hidden_layers} "
            f"(each pipeline stage needs at least one layer)"
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def shard_heads(cfg: ModelConfig, tp: TensorParallel) -> HeadShard:
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    local = heads // tp.size
    if kv >= tp.size:
        local_kv = kv // tp.size
        return HeadShard(local, local_kv, tp.rank * local, tp.rank * local_kv)
    # Replicated: tp.size // kv ranks share each KV head; this rank's query heads all read head r*kv//tp.
    return HeadShard(local, 1, tp.rank * local, tp.rank * kv // tp.size)


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first row, rows held (padded), real rows) of this rank's vocabulary shard."""
    padded = -(-vocab_size // tp.size)
    start = tp.rank * padded
    return start, padded, max(0, min(padded, vocab_size - start))


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows [start, start + shard) of the embedding; ids outside look up zeros, and the
    all-reduce sums the ranks' lookups into the full embedding. `weight` is (padded shard, hidden), so
    the same module serves as a tied LM head's shard."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        start, padded, _ = vocab_shard(vocab_size, tp)
        super().__init__(padded, hidden_size)
        self.tp = tp
        self.vocab_start = start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # (T,)
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        h = h.masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(h)


# ---------------------------------------------------------------------------------------------- checkpoint
@dataclass(frozen=True)
class CheckpointRead:
    """How a rank reads one checkpoint tensor: its local name, and the slice [start, stop) along `dim`
    (dim None: the whole tensor)."""

    name: str
    dim: Optional[int] = None
    start: int = 0
    stop: int = 0


_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.(.*)$")


def checkpoint_read(name: str, cfg: ModelConfig, parallel: ModelParallel) -> Optional[CheckpointRead]:
    """What this rank reads of checkpoint tensor `name` (Hugging Face Llama/Qwen names), None when
    nothing: another stage's layer, or a row-parallel bias another rank adds."""
    tp, stage = parallel.tp, parallel.stage
    bare = name.removeprefix("model.")
    m = _LAYER.match(name)
    if m is not None:
        local = stage.local_layer(int(m.group(2)))
        if local is None:
            return None
        rest = m.group(3)
        local_name = f"layers.{local}.{rest}"
        if tp.size == 1:
            return CheckpointRead(local_name)
        return _layer_slice(local_name, rest, cfg, tp)
    if bare.startswith("embed_tokens."):
        # The first stage embeds; with tied embeddings it is the LM head too (on the first stage as well).
        if not stage.is_first:
            return None
        return _vocab_rows(bare, cfg, tp)
    if bare.startswith("lm_head."):
        return _vocab_rows(bare, cfg, tp) if stage.is_first else None
    if bare.startswith("norm."):
        return CheckpointRead(bare) if stage.is_last else None
    return CheckpointRead(bare)  # unknown: the model's load_weights names it in its error


def _vocab_rows(name: str, cfg: ModelConfig, tp: TensorParallel) -> CheckpointRead:
    if tp.size == 1:
        return CheckpointRead(name)
    start, _, real = vocab_shard(cfg.vocab_size, tp)
    return CheckpointRead(name, 0, start, start + real)


def _layer_slice(local_name: str, rest: str, cfg: ModelConfig, tp: TensorParallel) -> Optional[CheckpointRead]:
    d = cfg.head_dim
    hs = shard_heads(cfg, tp)
    inter = cfg.intermediate_size // tp.size
    if rest.startswith("self_attn.q_proj."):
        return CheckpointRead(local_name, 0, hs.first_head * d, (hs.first_head + hs.num_heads) * d)
    if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return CheckpointRead(local_name, 0, hs.first_kv_head * d, (hs.first_kv_head + hs.num_kv_heads) * d)
    if rest == "self_attn.o_proj.weight":
        return CheckpointRead(local_name, 1, hs.first_head * d, (hs.first_head + hs.num_heads) * d)
    if rest == "self_attn.o_proj.bias":
        return CheckpointRead(local_name) if tp.rank == 0 else None
    if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return CheckpointRead(local_name, 0, tp.rank * inter, (tp.rank + 1) * inter)
    if rest == "mlp.down_proj.weight":
        return CheckpointRead(local_name, 1, tp.rank * inter, (tp.rank + 1) * inter)
    return CheckpointRead(local_name)  # norms (q_norm/k_norm per head too): replicated


# A decoder layer's projections, under the module that holds each (Hugging Face's names).
PROJECTIONS = {
    **{m: "self_attn" for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{m: "mlp" for m in ("gate_proj", "up_proj", "down_proj")},
}


def projection_slices(cfg: ModelConfig, tp: TensorParallel) -> dict[str, Optional[tuple[int, int, int]]]:
    """Per projection of a decoder layer, the slice of its weight (out, in) this rank holds, as the
    checkpoint reads it: (dim, start, stop), dim 0 its output rows (column-parallel: q/k/v, gate/up), dim 1
    its input columns (row-parallel: o, down); None where the rank holds it whole (one rank). What a
    LoRA adapter of the projection is cut by (runtime/lora/shard.py)."""
    slices: dict[str, Optional[tuple[int, int, int]]] = {}
    for module, parent in PROJECTIONS.items():
        read = _layer_slice("", f"{parent}.{module}.weight", cfg, tp) if tp.size > 1 else None
        slices[module] = None if read is None or read.dim is None else (read.dim, read.start, read.stop)
    return slices


def read_slice(handle, name: str, read: CheckpointRead) -> torch.Tensor:
    """The slice `read` asks for of tensor `name` from an open safetensors file (`safe_open`)."""
    if read.dim is None:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    shape = part.get_shape()
    if name.endswith("_scale") and (len(shape) <= read.dim or shape[read.dim] == 1):
        # An FP8 layer's per-tensor scale: every rank's slice of the layer shares it (a per-channel one,
        # (N, 1), is sliced with its rows like the weight).
        return handle.get_tensor(name)
    if read.dim == 0:
        return part[read.start : read.stop]
    return part[:, read.start : read.stop]
