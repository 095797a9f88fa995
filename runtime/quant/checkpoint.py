"""FP8 checkpoints as Hugging Face publishes them, loaded as they are (never widened):

- `quant_method: "fp8"` (vLLM / llm-compressor's older format): weights float8_e4m3fn, `weight_scale` per
  tensor (or per channel), `activation_scheme` "dynamic" or "static" (then an `input_scale` per layer),
  `ignored_layers` kept in bf16 (the LM head, usually);
- `quant_method: "compressed-tensors"`, format "float-quantized": one config group of 8-bit float weights,
  strategy "tensor" or "channel", activations "token"/"tensor" dynamic or "tensor" static; `ignore`.

Its parts: `Fp8CheckpointFormat.parse` (config.json's `quantization_config`, torch-free: the engine process
reads it before any model is built), `fp8_layers_for_checkpoint` (a built model's linear layers swapped for
empty `Fp8Linear`s before the weights stream in) and `copy_checkpoint_tensor` (what `load_weights` calls for
each tensor: scales broadcast into a fused layer's rows, FP8 codes copied bit for bit)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

FP8_METHODS = ("fp8", "compressed-tensors")
SCALE_SUFFIXES = ("weight_scale", "input_scale")


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    """What an FP8 checkpoint's config promises: its format, whether activations take the checkpoint's
    static `input_scale`s, and which layers stay unquantized (names or "re:" patterns, HF's module names)."""

    method: str  # "fp8" or "compressed-tensors"
    static_activations: bool
    ignore: tuple[str, ...] = ()

    @classmethod
    def parse(cls, quant: Any, source: str) -> Optional["Fp8CheckpointFormat"]:
        """config.json's `quantization_config` -> the format, None when it names no FP8 method (the caller
        refuses other methods); a ValueError naming `source` for FP8 variants plait cannot run."""
        if not isinstance(quant, dict) or quant.get("quant_method") not in FP8_METHODS:
            return None
        if quant["quant_method"] == "fp8":
            return cls._parse_fp8(quant, source)
        return cls._parse_compressed(quant, source)

    @classmethod
    def _parse_fp8(cls, quant: dict, source: str) -> "Fp8CheckpointFormat":
        if quant.get("weight_block_size"):
            raise ValueError(
                f"{source}: block-wise FP8 (weight_block_size {quant['weight_block_size']}) is not supported; "
                "plait runs FP8 checkpoints with per-tensor or per-channel weight scales"
            )
        fmt = quant.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{source}: FP8 format {fmt!r} is not supported (float8_e4m3fn only)")
        scheme = quant.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"{source}: activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
        return cls("fp8", scheme == "static", tuple(quant.get("ignored_layers") or ()))

    @classmethod
    def _parse_compressed(cls, quant: dict, source: str) -> "Fp8CheckpointFormat":
        where = f"{source}: compressed-tensors"
        if quant.get("format") != "float-quantized":
            raise ValueError(
                f"{where} format {quant.get('format')!r} is not supported; plait runs 'float-quantized' (FP8)"
            )
        groups = list((quant.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"{where}: expected one config group (FP8 on every Linear), got {len(groups)}")
        group = groups[0]
        if list(group.get("targets") or []) != ["Linear"]:
            raise ValueError(f"{where}: the config group must target ['Linear'], got {group.get('targets')}")
        weights = group.get("weights") or {}
        if (weights.get("num_bits"), weights.get("type")) != (8, "float") or weights.get("strategy") not in (
            "tensor",
            "channel",
        ):
            raise ValueError(
                f"{where}: weights must be 8-bit float with strategy 'tensor' or 'channel', got "
                f"num_bits={weights.get('num_bits')} type={weights.get('type')} strategy={weights.get('strategy')}"
            )
        acts = group.get("input_activations")
        static = False
        if acts is not None:  # None: weight-only FP8; plait still quantizes the activations per token
            if (acts.get("num_bits"), acts.get("type")) != (8, "float"):
                raise ValueError(f"{where}: input activations must be 8-bit float, got {acts}")
            static = not acts.get("dynamic", False)
            if static and acts.get("strategy") != "tensor":
                raise ValueError(f"{where}: static input activations must be per tensor, got {acts.get('strategy')}")
        return cls("compressed-tensors", static, tuple(quant.get("ignore") or ()))

    def ignores(self, checkpoint_module: str) -> bool:
        """Whether the module (HF's name, e.g. "lm_head" or "model.layers.0.mlp.down_proj") stays unquantized."""
        bare = checkpoint_module.removeprefix("model.")
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], checkpoint_module) or re.match(pattern[3:], bare):
                    return True
            elif pattern in (checkpoint_module, bare) or pattern.removeprefix("model.") == bare:
                return True
        return False


def fp8_layers_for_checkpoint(
    model: Any, fmt: Fp8CheckpointFormat, dtype: Any, checkpoint_parts: Callable[[str], list[str]]
) -> int:
    """Swap `model`'s nn.Linear layers for empty Fp8Linear ones of the same shape (on the same device),
    except the layers `fmt` ignores, before the checkpoint's tensors are loaded into them.
    `checkpoint_parts(name)`: the checkpoint modules a model module holds (a fused QKV: q, k and v), which
    must all be quantized or all ignored. Returns how many layers were swapped."""
    import torch.nn as nn

    from .fp8 import Fp8Linear

    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    swapped = 0
    for name, module in targets:
        parts = checkpoint_parts(name)
        ignored = [fmt.ignores(p) for p in parts]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"the FP8 checkpoint quantizes some of {parts} but not all, which plait fuses into one "
                "matmul; quantize all of them or none"
            )
        layer = Fp8Linear(
            module.in_features,
            module.out_features,
            module.bias is not None,
            dtype,
            module.weight.device,
            static_input_scale=fmt.static_activations,
        )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        swapped += 1
    return swapped


def copy_checkpoint_tensor(dst: Any, src: Any, name: str) -> bool:
    """Load checkpoint tensor `name` into `dst` (a parameter or its rows of a fused layer) when it is FP8's
    business, returning True then: a scale (per tensor: broadcast to dst's rows; per channel: its rows; an
    input scale: the largest of a fused layer's parts), or FP8 codes (copied bit for bit). False: a float
    tensor for a float parameter, which the caller copies. ValueError for a tensor of the wrong kind."""
    import torch

    from .fp8 import FP8_DTYPE

    if name.endswith("input_scale"):
        if src.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r} must be one per-tensor scale, got shape {tuple(src.shape)}")
        torch.maximum(dst, src.reshape(1).to(dst.device, torch.float32), out=dst)
        return True
    if name.endswith("weight_scale"):
        if src.numel() == 1:
            dst.fill_(src.reshape(()).item())
        elif src.numel() == dst.numel():
            dst.copy_(src.reshape(dst.shape))
        else:
            raise ValueError(
                f"checkpoint tensor {name!r} has {src.numel()} scales where its layer has {dst.numel()} output "
                "channels (plait reads per-tensor or per-channel FP8 weight scales)"
            )
        return True
    if dst.dtype == FP8_DTYPE or src.dtype == FP8_DTYPE:
        if dst.dtype != src.dtype:
            raise ValueError(
                f"checkpoint tensor {name!r} is {src.dtype} where plait expects {dst.dtype}: its config.json's "
                "quantization_config and the weights disagree on which layers are FP8"
            )
        if tuple(src.shape) != tuple(dst.shape):
            return False  # the caller's shape check names it
        dst.copy_(src)
        return True
    return False
