"""A LoRA adapter read from a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`), checked
against the base model's shapes, its weights kept in host memory in the layout plait's fused projections
need.

plait's models fuse q/k/v into one QKV matmul and gate/up into one gate-up matmul (models/llama.py), so an
adapter's targets are grouped the same way: each fused projection (a `LoraTarget`) has its sub-projections
(q, k, v; gate, up), each with its own A (r, in) and B (out, r). A sub-projection the adapter does not
target is None (it adds nothing). PEFT's scale (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into B
once here, so a forward multiplies twice and adds.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraError(ValueError):
    """An adapter that cannot be served: a missing file, a shape or target the base model does not have,
    a rank over the limit. The message names the adapter and what is wrong."""


@dataclass(frozen=True)
class LoraTarget:
    """One of the projections the models run as one matmul, and the PEFT module names fused into it."""

    name: str  # what the model's hook names it: "qkv", "o", "gate_up", "down"
    modules: tuple[str, ...]  # PEFT's target_modules names, in the fused matrix's output order


TARGETS = (
    LoraTarget("qkv", ("q_proj", "k_proj", "v_proj")),
    LoraTarget("o", ("o_proj",)),
    LoraTarget("gate_up", ("gate_proj", "up_proj")),
    LoraTarget("down", ("down_proj",)),
)
TARGET_OF_MODULE = {m: t for t in TARGETS for m in t.modules}


@dataclass(frozen=True)
class LoraShapes:
    """The base model's projection shapes an adapter must match (one device, the whole model)."""

    num_layers: int
    hidden: int
    q_size: int  # query heads x head dim
    kv_size: int  # KV heads x head dim
    intermediate: int

    @classmethod
    def of(cls, cfg) -> "LoraShapes":
        """From a models.config.ModelConfig."""
        return cls(
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
            cfg.intermediate_size,
        )

    def in_features(self, target: LoraTarget) -> int:
        return {"qkv": self.hidden, "o": self.q_size, "gate_up": self.hidden, "down": self.intermediate}[target.name]

    def out_features(self, module: str) -> int:
        return {
            "q_proj": self.q_size,
            "k_proj": self.kv_size,
            "v_proj": self.kv_size,
            "o_proj": self.hidden,
            "gate_proj": self.intermediate,
            "up_proj": self.intermediate,
            "down_proj": self.hidden,
        }[module]

    def out_total(self, target: LoraTarget) -> int:
        return sum(self.out_features(m) for m in target.modules)


# PEFT's saved names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (older files may keep
# the adapter's name: ...lora_A.default.weight).
_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoraAdapter:
    """An adapter's weights on the host: `weights[module]` = (A (L, r, in), B (L, out, r) scaled), None
    for a module it does not target; a layer it leaves alone holds zeros."""

    name: str
    path: str
    rank: int
    weights: dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]]

    def modules_of(self, target: LoraTarget) -> list[Optional[tuple[torch.Tensor, torch.Tensor]]]:
        return [self.weights.get(m) for m in target.modules]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for w in self.weights.values() if w is not None for a, b in [w])


def read_adapter(name: str, path: str, shapes: LoraShapes, max_rank: int) -> LoraAdapter:
    """The PEFT folder at `path` as adapter `name`; a LoraError naming what does not fit."""
    config = _read_config(name, path)
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} has no positive integer rank 'r' (got {rank!r})")
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r} has rank {rank}, over the server's limit --max-lora-rank {max_rank}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoraError(f"LoRA adapter {name!r}: per-module ranks or alphas ({key}) are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("use_dora"):
        raise LoraError(f"LoRA adapter {name!r}: DoRA adapters are not supported")
    alpha = config.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, path)
    return LoraAdapter(name, path, rank, _arrange(name, tensors, shapes, rank, scale))


def _read_config(name: str, path: str) -> dict:
    if not os.path.isdir(path):
        raise LoraError(f"LoRA adapter {name!r}: {path!r} is not a folder")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoraError(f"LoRA adapter {name!r}: {file!r} is missing (a PEFT adapter folder has one)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {file!r}: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"LoRA adapter {name!r}: {file!r} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoraError(f"LoRA adapter {name!r}: {file!r} is missing (only safetensors adapters are read)")
    try:
        return load_file(file, device="cpu")
    except Exception as e:  # a truncated or foreign file: safetensors raises its own error types
        raise LoraError(f"LoRA adapter {name!r}: cannot read {file!r}: {e}") from None


def _arrange(
    name: str, tensors: dict[str, torch.Tensor], shapes: LoraShapes, rank: int, scale: float
) -> dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """PEFT's per-layer tensors -> per module (A (L, r, in), B * scale (L, out, r)), shapes checked."""
    found: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _NAME.search(key)
        if m is None:
            raise LoraError(
                f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B matrix of a decoder layer's projection "
                f"(plait serves adapters on {', '.join(TARGET_OF_MODULE)})"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_OF_MODULE:
            raise LoraError(
                f"LoRA adapter {name!r} targets {module!r}, which plait does not adapt "
                f"(it adapts {', '.join(TARGET_OF_MODULE)})"
            )
        if layer >= shapes.num_layers:
            raise LoraError(
                f"LoRA adapter {name!r}: {key!r} is for layer {layer}; the base model has {shapes.num_layers}"
            )
        found.setdefault((module, which), {})[layer] = tensor
    weights: dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, target in TARGET_OF_MODULE.items():
        a_layers, b_layers = found.get((module, "A"), {}), found.get((module, "B"), {})
        if not a_layers and not b_layers:
            weights[module] = None
            continue
        if set(a_layers) != set(b_layers):
            raise LoraError(f"LoRA adapter {name!r}: {module} has lora_A and lora_B for different layers")
        fan_in, fan_out = shapes.in_features(target), shapes.out_features(module)
        a = torch.zeros(shapes.num_layers, rank, fan_in)  # (L, r, in)
        b = torch.zeros(shapes.num_layers, fan_out, rank)  # (L, out, r)
        for layer in a_layers:
            _check_shape(name, module, layer, "A", a_layers[layer], (rank, fan_in))
            _check_shape(name, module, layer, "B", b_layers[layer], (fan_out, rank))
            a[layer] = a_layers[layer].float()
            b[layer] = b_layers[layer].float() * scale
        weights[module] = (a, b)
    if all(w is None for w in weights.values()):
        raise LoraError(f"LoRA adapter {name!r} holds no LoRA weights")
    return weights


def _check_shape(name: str, module: str, layer: int, which: str, tensor: torch.Tensor, want: tuple) -> None:
    if tuple(tensor.shape) != want:
        raise LoraError(
            f"LoRA adapter {name!r}: layer {layer} {module}.lora_{which} has shape {tuple(tensor.shape)}, but the "
            f"base model and the adapter's rank imply {want}: an adapter trained for another base model?"
        )
