"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window).

Qwen2/2.5/3 reuse this module with flags (`attention_bias`, `qk_norm`); see qwen.py.
Q/K/V and gate/up projections are fused at load time (one matmul each). Opt in (ServerArgs
`enable_fused_decode_row`, off by default: measured slower, see layers.fuses_decode_row; FP8 layers:
quant/fp8_rows.FP8_FUSED_ROW), a batch-1 decode step (one row, on CUDA) runs each norm and SiLU-and-mul inside the
matmul after it: `DecoderLayer._forward_one_row`.

Split over ranks (models/parallel.py), a model holds its rank's shard: its heads and MLP columns (an
all-reduce after o_proj and down_proj), its vocabulary rows, its pipeline stage's layers.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.nn as nn

from ..attention.base import AttentionLayerSpec
from ..forward_batch import ForwardBatch
from ..quant.fp8 import Fp8Rows
from .config import ModelConfig
from .cpu_matmul import cpu_linear
from .layers import (
    RMSNorm,
    SiluAndMul,
    fuses_decode_row,
    norm_for_linear,
    norm_linear,
    one_row_linear,
    one_row_norm_linear,
    one_row_silu_linear,
    silu_and_mul_for_linear,
    skinny_linear,
    weight_rows,
)
from .parallel import (
    ONE_RANK,
    CheckpointRead,
    ModelParallel,
    TensorParallel,
    VocabParallelEmbedding,
    checkpoint_read,
    shard_heads,
    vocab_shard,
)
from .rotary import RotaryEmbedding
from .weights import load_checkpoint_weights


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TensorParallel = ONE_RANK):
        super().__init__()
        heads = shard_heads(cfg, tp)  # this rank's query and KV heads (all of them on one rank)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.tp = tp
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Row-parallel: the ranks' outputs are summed, so rank 0 alone adds the bias.
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias and tp.rank == 0)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.spec = AttentionLayerSpec(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if fb.lora is None:
            qkv = skinny_linear(x, self.qkv_proj)  # (T, q + 2kv)
            return self.tp.all_reduce(skinny_linear(self.attend(positions, qkv, fb), self.o_proj))  # (T, hidden)
        # LoRA adapters (runtime/lora/matmul.py): each row's adapter begun beside the fused base matmul
        # (the shrink reads only the input), finished into its output.
        lora, layer = fb.lora, self.spec.layer_id
        pending = lora.begin(layer, "qkv", x)
        o = self.attend(positions, lora.finish(pending, skinny_linear(x, self.qkv_proj)), fb)  # (T, H * D)
        pending = lora.begin(layer, "o", o)
        return self.tp.all_reduce(lora.finish(pending, skinny_linear(o, self.o_proj)))  # (T, hidden)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """qkv (T, q + 2kv) -> attention output (T, H * D), before o_proj; stores this step's K/V."""
        q = self.query_and_store(positions, qkv, fb)
        return fb.attn_backend.forward(q, None, None, self.spec, fb, kv_stored=True)  # (T, H * D)

    def query_and_store(self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """qkv (T, q + 2kv) -> the rotated queries (T, H, D); this step's K/V rotated and stored in the pool
        (what a piecewise CUDA graph holds of the attention: executor/piecewise_graphs.py)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        layer, pool = self.spec.layer_id, fb.kv_pool
        if self.rotary.fuses_kv_store(q) and pool.stores_from(k.dtype):
            # NOTE: one launch instead of three (rotary, K store, V store): at decode batch 1 each
            # launch costs more than its work. An FP8 pool's K/V are quantized by the same kernel.
            return self.rotary.rotate_and_store_kv(
                positions,
                q,
                k,
                v,
                pool.k_buffer[layer],
                pool.v_buffer[layer],
                fb.out_cache_loc,
                pool.layer_scales(layer),
            )
        q, k = self.rotary(positions, q, k)
        pool.set_kv(layer, fb.out_cache_loc, k, v)
        return q


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = ONE_RANK, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id  # (which layer's LoRA weights apply)
        inter = cfg.intermediate_size // tp.size  # this rank's columns of gate/up, rows of down
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: Union[torch.Tensor, Fp8Rows], fb: Optional[ForwardBatch] = None) -> torch.Tensor:
        lora = fb.lora if fb is not None else None
        if lora is None:  # (FP8 layers: the activation may write down_proj's FP8 rows itself)
            gate_up = skinny_linear(x, self.gate_up_proj)  # (T, 2 * inter); one row: the skinny matmul
            h = silu_and_mul_for_linear(self.act_fn, gate_up, self.down_proj)
            return self.tp.all_reduce(skinny_linear(h, self.down_proj))  # (T, hidden)
        assert isinstance(x, torch.Tensor)
        pending = lora.begin(self.layer_id, "gate_up", x)
        h = self.act_fn(lora.finish(pending, skinny_linear(x, self.gate_up_proj)))  # (T, inter)
        pending = lora.begin(self.layer_id, "down", h)
        return self.tp.all_reduce(lora.finish(pending, skinny_linear(h, self.down_proj)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary, tp)
        self.mlp = MLP(cfg, tp, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, h, residual, fb):
        if fb.lora is None and fuses_decode_row(h, self.mlp.down_proj.weight, self.input_layernorm.use_triton):
            return self._forward_one_row(positions, h, residual, fb)
        if fb.lora is None:
            q, residual = self.attention_input(positions, h, residual, fb)
            return self.attention_output(
                fb.attn_backend.forward(q, None, None, self.self_attn.spec, fb, True), residual
            )
        h, residual = self._input_norm(h, residual)
        h = self.self_attn(positions, h, fb)  # (the projections with each row's LoRA adapter)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, fb), residual

    def attention_input(self, positions, h, residual, fb):
        """The layer up to its attention kernel: (rotated queries (T, H, D), the residual stream (T, hidden));
        this step's K/V stored. `forward` without LoRA is this, the attention, then `attention_output`: a
        piecewise CUDA graph (executor/piecewise_graphs.py) holds the two parts, the attention runs between."""
        attn = self.self_attn
        x, residual = norm_for_linear(self.input_layernorm, h, residual, attn.qkv_proj)  # FP8 layers: maybe FP8 rows
        return attn.query_and_store(positions, skinny_linear(x, attn.qkv_proj), fb), residual

    def attention_output(self, o, residual):
        """The attention's output o (T, H * D) -> (the layer's output, the residual stream), both (T, hidden)."""
        h = self.self_attn.tp.all_reduce(skinny_linear(o, self.self_attn.o_proj))  # (T, hidden)
        x, residual = norm_for_linear(self.post_attention_layernorm, h, residual, self.mlp.gate_up_proj)
        return self.mlp(x), residual

    def _input_norm(self, h, residual):
        # NOTE: on CUDA the norms add h into `residual` in place (fused kernel); residual starts as this
        # step's embedding output, a fresh buffer that nothing else reads.
        if residual is None:
            return self.input_layernorm(h), h
        return self.input_layernorm(h, residual)

    def _forward_one_row(self, positions, h, residual, fb):
        # A batch-1 decode step: the norms run inside the matmuls after them and SiLU-and-mul inside the
        # down projection (runtime/kernels/gemv_fused.py), 7 launches a layer instead of 10-11, where
        # layers.fuses_prologue says so. A fused norm writes the residual sum to a new buffer; one run apart
        # adds into the residual in place, as on the other paths.
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = one_row_norm_linear(h, residual, self.input_layernorm, attn.qkv_proj, "qkv")  # (1, q + 2kv)
        h = attn.tp.all_reduce(one_row_linear(attn.attend(positions, qkv, fb), attn.o_proj))  # (1, hidden)
        gate_up, residual = one_row_norm_linear(h, residual, self.post_attention_layernorm, mlp.gate_up_proj, "gate_up")
        return mlp.tp.all_reduce(one_row_silu_linear(gate_up, mlp.act_fn, mlp.down_proj)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, parallel: Optional[ModelParallel] = None):
        super().__init__()
        self.config = cfg
        self.parallel = parallel = parallel or ModelParallel.single()
        tp, stage = parallel.tp, parallel.stage
        # The first pipeline stage embeds and holds the LM head; the last one the final norm. (Built in
        # this order whatever the split: dummy weights are drawn in parameter order.)
        self.embed_tokens = None
        if stage.is_first:
            self.embed_tokens = (
                nn.Embedding(cfg.vocab_size, cfg.hidden_size)
                if tp.size == 1
                else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
            )
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        # Local layer indices: they index this rank's KV pool (a stage holds its own layers' KV only).
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, tp) for i in range(stage.layer_count(cfg.num_hidden_layers))
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None
        self.lm_head = None
        if stage.is_first and not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, vocab_shard(cfg.vocab_size, tp)[1], bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h, residual = self._decoder(input_ids, positions, fb)
        if residual is None:  # a model with no layers
            return self.norm(h)
        h, _ = self.norm(h, residual)
        return h  # (T, hidden)

    def forward_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, carried: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """A pipeline stage's part: its layers over `carried` ((2, T, hidden): the previous stage's output
        and residual stream; None on the first stage, which embeds `input_ids`) -> (2, T, hidden) for the
        next stage, or on the last stage the final normed hidden states (T, hidden)."""
        h, residual = self._decoder(input_ids, positions, fb, None if carried is None else (carried[0], carried[1]))
        if self.parallel.stage.is_last:
            return self.norm(h, residual)[0]
        return torch.stack([h, residual])

    def _decoder(self, input_ids, positions, fb, carried=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Embedding (or a previous stage's (output, residual): `carried`) and every layer: (the last
        layer's output, the residual stream before it; None without layers), both (T, hidden), the
        final norm still to apply. A drafter's (EAGLE-3) layers, `fb.capture_layers`: their inputs are kept
        in `fb.captured_hidden` (speculation runs on one device: these are the model's own layer numbers)."""
        if carried is None:
            h = self.embed_tokens(input_ids)  # (T, hidden)
            residual = None
        else:
            h, residual = carried
        capture = fb.capture_layers
        for i, layer in enumerate(self.layers):
            if capture and i in capture:
                fb.captured_hidden.append(h if residual is None else h + residual)
            h, residual = layer(positions, h, residual, fb)
        if capture and len(self.layers) in capture:  # past the last layer: the final norm's input
            fb.captured_hidden.append(h if residual is None else h + residual)
        return h, residual

    def head(self) -> nn.Module:
        """The LM head: its own linear, or the token embedding where the checkpoint ties them."""
        return self.embed_tokens if self.lm_head is None else self.lm_head  # both hold a (vocab, hidden) weight

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) float32, written into `out` ((N, vocab) float32) when
        given (the decode CUDA graphs' shared logits buffer) at no extra pass."""
        if out is not None and out.dtype != torch.float32:
            raise ValueError(f"logits out must be float32, got {out.dtype}")
        tp = self.parallel.tp
        if tp.size == 1:
            return skinny_linear(hidden, self.head(), out_dtype=torch.float32, out=out)  # (N, vocab)
        local = skinny_linear(hidden, self.head(), out_dtype=torch.float32)  # (N, this rank's vocab rows)
        return tp.gather_columns(local, self.config.vocab_size, out=out)  # (N, vocab)

    def logits_at(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows' logits at `token_ids` (n,) alone: hidden (R, hidden) -> (R, n) float32, through the LM head's
        rows for those tokens in the head's dtype, as compute_logits runs the whole head (one device: the
        whole vocabulary's rows are here at tp 1). A step whose rows a grammar narrows to a few tokens
        reads those rows of the head, not all of it (executor/sampler.py; a verify step's nodes each with
        their own tokens, executor/verify.py). The same matmul as the whole head's on the CPU
        (skinny_linear's F.linear, then float32), over fewer columns."""
        rows = weight_rows(self.head(), token_ids)  # (n, hidden)
        return cpu_linear(hidden.to(rows.dtype), rows).float()  # (R, n)

    def forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """compute_logits(forward(...), out) (T, vocab) float32, for callers that need no hidden states (the
        decode CUDA graph): on the one-row path (when switched on) the final norm runs inside the LM head's
        matmul; otherwise it is the norm, then compute_logits."""
        h, residual = self._decoder(input_ids, positions, fb)
        head = self.head()
        if residual is not None and fuses_decode_row(h, head.weight, self.norm.use_triton):
            logits = norm_linear(h, residual, self.norm, head, out_dtype=torch.float32)[0]  # (1, vocab shard)
            logits = self.parallel.tp.gather_columns(logits, self.config.vocab_size)  # (1, vocab)
            if out is None:
                return logits
            if out.dtype != torch.float32 or out.shape != logits.shape:
                raise ValueError(
                    f"logits out must be float32 {tuple(logits.shape)}, got {out.dtype} {tuple(out.shape)}"
                )
            return out.copy_(logits)  # NOTE: the fused kernel takes no `out`; one row, opt-in path
        return self.compute_logits(self.norm(h) if residual is None else self.norm(h, residual)[0], out=out)

    # ---- weights ----
    STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # A fused module -> its checkpoint parts in order (an FP8 checkpoint's ignore list names the parts).
    FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def text_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """The decoder's parameters, which `load_weights` fills and checks (a VLM's tower loads apart)."""
        return self.named_parameters()

    def checkpoint_read(self, name: str) -> Optional[CheckpointRead]:
        """What this rank reads of checkpoint tensor `name`: its slice and local name, or None (see
        models/parallel.py). The loader reads only that; `load_weights` then takes it by its local name."""
        return checkpoint_read(name, self.config, self.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into one matrix each (models/weights.py). Split over
        ranks, the tensors are this rank's slices under their local names (`checkpoint_read`)."""
        load_checkpoint_weights(self, weights)
