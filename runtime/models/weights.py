"""A Llama-family model's weights from a checkpoint's tensors, named as Hugging Face names them: q/k/v and
gate/up fused into one matrix each (their rows at each part's offset), a rank's slices under their local
names, FP8 codes and scales copied as they are (quant/checkpoint.py), and the errors that name what does not
fit: an unexpected tensor, a shape the config does not imply, the weights a checkpoint misses."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..quant.checkpoint import SCALE_SUFFIXES, copy_checkpoint_tensor
from .config import ModelConfig
from .parallel import shard_heads

# Checkpoint tensors that are the KV cache's scales, not weights (executor/kv_scales.py reads them).
_KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")


def load_checkpoint_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named tensors into `model` (a LlamaForCausalLM: its parameters, config, parallel split and
    fused parts), fusing q/k/v and gate/up into one matrix each. Split over ranks,
    the tensors are this rank's slices under their local names (`model.checkpoint_read`)."""
    params = dict(model.text_parameters())
    cfg = model.config
    hs = shard_heads(cfg, model.parallel.tp)  # this rank's heads and MLP columns
    q, kv = hs.num_heads * cfg.head_dim, hs.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size // model.parallel.tp.size
    vocab_parallel = model.parallel.tp.size > 1
    offsets = {"qkv_proj": [(0, q), (q, kv), (q + kv, kv)], "gate_up_proj": [(0, inter), (inter, inter)]}
    loaded = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or name.endswith(_KV_SCALE_SUFFIXES):
            continue  # (KV-cache scales are the KV pool's: executor/kv_scales.py reads them)
        if name == "lm_head.weight" and model.lm_head is None:
            continue
        for part, (fused, idx) in model.STACKED.items():
            if f".{part}." in name:
                target = name.replace(part, fused)
                if target not in params:
                    raise ValueError(_unexpected(name, cfg))
                start, size = offsets[fused][idx]
                dst = params[target].data
                # (an FP8 layer's static input scale is one for the fused matmul: not split by rows)
                copy_checked(dst if name.endswith("input_scale") else dst[start : start + size], tensor, name)
                loaded.add(f"{target}#{idx}")
                break
        else:
            if name not in params:
                raise ValueError(_unexpected(name, cfg))
            dst = params[name].data
            if vocab_parallel and name in ("embed_tokens.weight", "lm_head.weight"):
                dst[tensor.shape[0] :].zero_()  # the last shard's padding rows: never looked up, logits cut off
                dst = dst[: tensor.shape[0]]
            copy_checked(dst, tensor, name)
            loaded.add(name)
    expected = set()
    for pname in params:
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in pname and pname.endswith(_PER_PART)), None)
        if fused == "qkv_proj":
            expected |= {f"{pname}#{i}" for i in range(3)}
        elif fused == "gate_up_proj":
            expected |= {f"{pname}#{i}" for i in range(2)}
        elif ".qkv_proj.bias" in pname:
            expected |= {f"{pname}#{i}" for i in range(3)}
        else:
            expected.add(pname)
    missing = sorted(expected - loaded)
    if missing:
        hint = (
            " (config.json says tie_word_embeddings=false, so the checkpoint needs its own lm_head.weight)"
            if "lm_head.weight" in missing
            else ""
        )
        scales = [m for m in missing if m.partition("#")[0].endswith(SCALE_SUFFIXES)]
        if scales:  # named first: a scale missing is the FP8 checkpoint's fault, not the config's shape
            missing = scales + [m for m in missing if m not in scales]
            hint = " (config.json's quantization_config says FP8: each quantized layer needs its scales)"
        raise ValueError(
            f"checkpoint is missing {len(missing)} weight(s) that a {cfg.architecture} with this "
            f"config.json has, e.g. {[_checkpoint_name(model, m) for m in missing[:3]]}{hint}"
        )


def _checkpoint_name(model: Any, loaded_key: str) -> str:
    """A `loaded` key ('layers.0.self_attn.qkv_proj.weight#1') -> the checkpoint's name for it."""
    name, _, idx = loaded_key.partition("#")
    for part, (fused, i) in model.STACKED.items():
        if idx and f".{fused}." in name and i == int(idx):
            name = name.replace(fused, part)
            break
    stage = model.parallel.stage
    if name.startswith("layers.") and stage.num_layers >= 0:  # a stage's local layer index -> the model's
        layer, _, rest = name[len("layers.") :].partition(".")
        name = f"layers.{int(layer) + stage.first_layer}.{rest}"
    return name if name == "lm_head.weight" else "model." + name


# A fused layer's parameters that each checkpoint part fills: its rows of the weight (and of an FP8
# layer's weight scales), and an FP8 layer's input scale (the largest of the parts').
_PER_PART = ("weight", "weight_scale", "input_scale")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    with torch.no_grad():
        if copy_checkpoint_tensor(dst, src, name):  # FP8 codes and scales (runtime/quant/checkpoint.py)
            return
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"checkpoint weight {name!r} has shape {tuple(src.shape)} where config.json implies "
            f"{tuple(dst.shape)}: the config and the weights are not of the same model"
        )
    with torch.no_grad():
        dst.copy_(src)


def _unexpected(name: str, cfg: ModelConfig) -> str:
    return (
        f"unexpected weight {name!r} in checkpoint: a {cfg.architecture} with this config.json has no such "
        f"weight (weights saved by transformers for another architecture or format?)"
    )
