"""EAGLE and EAGLE-3 draft heads for Llama-family targets, loaded from their Hugging Face folders (config.json
+ safetensors) under the weight names SGLang's loaders read.

EAGLE (`LlamaForCausalLMEagle`, or a head folder whose config says LlamaForCausalLM): the input token's
embedding and a feature (the target's last hidden state, after its final norm; in later draft steps the
head's own output) are concatenated and projected (`fc`, 2h -> h, with a bias), then run through the
head's decoder layers (the first without its input norm); the output is hidden + residual, with no final
norm, and the target's LM head turns it into logits. Weights: `fc.*`, `layers.N.*`, optionally
`embed_tokens.weight` (else the target's).

EAGLE-3 (`LlamaForCausalLMEagle3`): the feature is three of the target's hidden states (the inputs of
layers aux + 1, `eagle_config.eagle_aux_hidden_state_layer_ids`; by default layers 1, L/2 - 1, L - 4),
concatenated and projected (`fc`, 3h -> h); later steps feed the head's own output. One decoder layer
(`midlayer.*`) whose attention reads [input_layernorm(embedding), hidden_norm(feature)] (2h wide); its
output goes through `norm` into the head's own `lm_head` over a draft vocabulary whose ids map to the
target's through `d2t` (target id = draft id + d2t[draft id]).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn as nn

from ..forward_batch import ForwardBatch
from ..models.config import ModelConfig
from ..models.layers import RMSNorm
from ..models.llama import MLP, Attention
from ..models.rotary import RotaryEmbedding

EAGLE_ARCHITECTURES = {
    "LlamaForCausalLMEagle": "EAGLE",
    "LlamaForCausalLMEagle3": "EAGLE3",
    "LlamaForCausalLM": "EAGLE",
}


@dataclass
class HeadConfig:
    kind: str  # "EAGLE" | "EAGLE3"
    model: ModelConfig  # the head's decoder shape (its own heads, intermediate size, rope)
    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: the target layers whose outputs are the feature
    fc_bias: bool

    @classmethod
    def from_folder(cls, path: str, algorithm: str, target: ModelConfig) -> "HeadConfig":
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"no config.json in the {algorithm} head folder {path!r}")
        with open(cfg_file) as f:
            raw = json.load(f)
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        kind = EAGLE_ARCHITECTURES.get(arch)
        if kind is None:
            raise ValueError(
                f"{cfg_file}: architecture {arch!r} is no EAGLE head plait knows ({sorted(EAGLE_ARCHITECTURES)})"
            )
        if kind != algorithm:
            raise ValueError(f"{cfg_file} is an {kind} head ({arch}), but speculative_algorithm={algorithm}")
        mc = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]}, source=cfg_file)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(
                f"the {algorithm} head in {path!r} has a vocabulary of {mc.vocab_size} tokens, the "
                f"target {target.vocab_size}: a head drafts for the model it was trained on"
            )
        target_hidden = raw.get("target_hidden_size") or mc.hidden_size
        if target_hidden != target.hidden_size or (kind == "EAGLE" and mc.hidden_size != target.hidden_size):
            raise ValueError(
                f"the {algorithm} head in {path!r} reads hidden states of size {target_hidden}, the "
                f"target's are {target.hidden_size}"
            )
        if kind == "EAGLE3" and mc.num_hidden_layers != 1:
            raise ValueError(
                f"{cfg_file}: plait's EAGLE-3 heads have one decoder layer, this one {mc.num_hidden_layers}"
            )
        n = target.num_hidden_layers
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(aux) if aux else (1, n // 2 - 1, n - 4)
        if kind == "EAGLE3" and not all(0 <= a < n for a in aux):
            raise ValueError(
                f"{cfg_file}: eagle_aux_hidden_state_layer_ids {list(aux)} are not layers of the {n}-layer target"
            )
        return cls(
            kind,
            mc,
            target_hidden,
            raw.get("draft_vocab_size") or mc.vocab_size,
            aux,
            fc_bias=bool(raw.get("bias", kind == "EAGLE")),
        )

    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the head reads (forward_batch.capture_layers)."""
        return tuple(sorted({a + 1 for a in self.aux_layer_ids})) if self.kind == "EAGLE3" else ()


class _HeadLayer(nn.Module):
    """A Llama decoder layer; EAGLE's first has no input norm, EAGLE-3's attention reads 2h."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, input_norm: bool, wide: bool):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary)
        if wide:
            a = self.self_attn
            self.self_attn.qkv_proj = nn.Linear(2 * cfg.hidden_size, a.q_size + 2 * a.kv_size, bias=False)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class EagleHead(nn.Module):
    def __init__(self, hc: HeadConfig, max_position: int):
        super().__init__()
        self.hc = hc
        cfg = hc.model
        h = cfg.hidden_size
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens: Optional[nn.Embedding] = None  # the checkpoint's own, else the target's
        if hc.kind == "EAGLE":
            self.fc = nn.Linear(2 * h, h, bias=hc.fc_bias)
            self.layers = nn.ModuleList(
                _HeadLayer(cfg, i, rotary, input_norm=i > 0, wide=False) for i in range(cfg.num_hidden_layers)
            )
            self.norm = self.lm_head = None
        else:
            self.fc = nn.Linear(3 * hc.target_hidden_size, h, bias=hc.fc_bias)
            self.midlayer = _HeadLayer(cfg, 0, rotary, input_norm=True, wide=True)
            self.midlayer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, hc.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(hc.draft_vocab_size, dtype=torch.int64), persistent=False)
        self._target_embed: Optional[nn.Module] = None
        self._target_logits = None

    def attach_target(self, target: nn.Module) -> None:
        """The target's embedding (when the checkpoint has none) and LM head (EAGLE)."""
        self._target_embed = target.embed_tokens
        self._target_logits = target.compute_logits

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers) if self.hc.kind == "EAGLE" else 1

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._target_embed)(ids)

    def forward(
        self, input_ids: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) ids, (T, f) features -> (logits (T, V_draft) float32, the head's output (T, h): the
        feature of the next draft step)."""
        e = self.embed(input_ids)  # (T, h)
        if self.hc.kind == "EAGLE":
            x = self.fc(torch.cat([e, feature.to(e.dtype)], dim=-1))  # (T, h)
            residual = None
            for layer in self.layers:
                if residual is None:
                    residual = x
                else:
                    x, residual = layer.input_layernorm(x, residual)
                x = layer.self_attn(positions, x, fb)
                x, residual = layer.post_attention_layernorm(x, residual)
                x = layer.mlp(x)
            out = x + residual  # (T, h)
            return self._target_logits(out), out
        feature = feature.to(e.dtype)
        if feature.shape[-1] != e.shape[-1]:
            feature = self.fc(feature)  # (T, 3h) -> (T, h): the target's layers, first step only
        layer = self.midlayer
        residual = feature.clone()  # NOTE: the fused norms on CUDA add into the residual in place
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(feature)], dim=-1)  # (T, 2h)
        x = layer.self_attn(positions, x, fb)
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
        normed, out = self.norm(x, residual)  # out: the pre-norm sum, the next step's feature
        return torch.nn.functional.linear(normed, self.lm_head.weight).float(), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.hc.kind == "EAGLE3" else draft_ids

    # ---- weights ----
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        cfg = self.hc.model
        q, kv, inter = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
            cfg.intermediate_size,
        )
        offsets = {"qkv_proj": [(0, q), (q, kv), (q + kv, kv)], "gate_up_proj": [(0, inter), (inter, inter)]}
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.int64))
                continue
            if (
                name == "t2d"
                or (name == "lm_head.weight" and self.hc.kind == "EAGLE")
                or name == "norm.weight"
                and self.hc.kind == "EAGLE"
            ):
                continue  # EAGLE uses the target's LM head (and has no norm of its own)
            if name == "embed_tokens.weight":
                self.embed_tokens = nn.Embedding(*tensor.shape, dtype=tensor.dtype, device=self.fc.weight.device)
                params["embed_tokens.weight"] = self.embed_tokens.weight
            part = next((p for p in self._FUSED if f".{p}." in name), None)
            if part is not None:
                fused, idx = self._FUSED[part]
                target = name.replace(part, fused)
                if target not in params:
                    raise ValueError(f"{source}: unexpected weight {name!r} for an {self.hc.kind} head")
                start, size = offsets[fused][idx]
                _copy(params[target].data[start : start + size], tensor, name, source)
                loaded.add(f"{target}#{idx}")
                continue
            if name not in params:
                raise ValueError(f"{source}: unexpected weight {name!r} for an {self.hc.kind} head")
            _copy(params[name].data, tensor, name, source)
            loaded.add(name)
        expected = set()
        for pname in params:
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in pname), None)
            if pname == "embed_tokens.weight":
                continue
            expected |= {f"{pname}#{i}" for i in range(3 if fused == "qkv_proj" else 2)} if fused else {pname}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(
                f"{source} lacks {len(missing)} weight(s) an {self.hc.kind} head with this config.json "
                f"has, e.g. {missing[:3]}"
            )


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str, source: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{source}: weight {name!r} has shape {tuple(src.shape)}, its config.json implies {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)
