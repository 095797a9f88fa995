"""A loaded model's linear layers replaced by quantized ones (the gpt-fast way: quantization transforms a
clean model after its weights are in, so the model files know nothing of it beyond the dispatch in
models/layers.skinny_linear)."""

from __future__ import annotations

import torch
import torch.nn as nn

from .fp8 import Fp8Linear
from .linear import Int4Linear, Int8Linear, QuantizedLinear

# What `quantization` may name, and the layer class of each.
QUANTIZED_LINEARS: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}


def quantize_linears(model: nn.Module, method: str, dtype: torch.dtype) -> int:
    """Replace every nn.Linear of `model` by `method`'s layer (activations in `dtype`), and give a model
    whose LM head is its embedding (tied) an int8 copy of it as `lm_head`: the head is the largest matrix
    of a small model, read at every step, while the embedding keeps its float rows for lookups. The head
    is int8 under int4 too: its logits pick every token. Returns how many layers were replaced.

    fp8 (the GPU's): see `quantize_fp8`; layers already FP8 (an FP8 checkpoint's) are left as they are."""
    if method == "fp8":
        return quantize_fp8(model, dtype)
    cls = QUANTIZED_LINEARS[method]
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        layer_cls = Int8Linear if attr == "lm_head" else cls
        with torch.no_grad():
            quantized = layer_cls(module.weight, module.bias, dtype)
        setattr(model.get_submodule(parent) if parent else model, attr, quantized)
    replaced = len(targets)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and isinstance(embed, nn.Embedding):
        with torch.no_grad():
            model.lm_head = Int8Linear(embed.weight, None, dtype)
        replaced += 1
    return replaced


def quantize_fp8(model: nn.Module, dtype: torch.dtype) -> int:
    """Every nn.Linear of `model` but the LM head to FP8 with per-output-channel scales, one layer at a time
    (the float weight is freed as its FP8 copy is made, so the peak is the model plus one layer). The LM
    head stays in `dtype`, as FP8 checkpoints keep it: its logits rank every token (sampling, logprobs)
    and an FP8 head would move them for a small share of the weight bytes (8B: 6%), and a tied head is the
    embedding, whose rows are looked up in float. Returns how many layers were replaced."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] != "lm_head"
    ]
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        with torch.no_grad():
            quantized = Fp8Linear.from_float(module.weight, module.bias, dtype)
        setattr(model.get_submodule(parent) if parent else model, attr, quantized)
        module.weight = module.bias = None  # NOTE: freed now, not when the loop ends
    return len(targets)
