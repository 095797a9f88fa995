"""The LoRA benchmark's inputs, shared by plait's side (bench_lora.py) and vLLM's (vllm_lora_peer.py): random
PEFT adapter folders for a built-in model shape, and the shape itself. Needs torch and safetensors only (no
plait), so vLLM's own Python can import it on the GPU machine: both sides write the same adapters there
(same seeds, same weights), none is carried over.
"""

from __future__ import annotations

import ast
import json
import os

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "runtime", "models", "config.py")


def builtin_shape(name: str) -> dict:
    """plait's BUILTIN_SHAPES[name] (a Hugging Face config's fields): imported where plait is, else read from
    runtime/models/config.py's source (the table is plain `dict(...)` literals)."""
    try:
        from plait.runtime.models.config import BUILTIN_SHAPES
    except ImportError:
        with open(CONFIG_PY) as f:
            tree = ast.parse(f.read())
        table = next(
            node.value
            for node in tree.body
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "BUILTIN_SHAPES"
        )
        BUILTIN_SHAPES = _literal(table)
    if name not in BUILTIN_SHAPES:
        raise SystemExit(f"unknown shape {name!r}: one of {', '.join(sorted(BUILTIN_SHAPES))}")
    return BUILTIN_SHAPES[name]


def _literal(node: ast.AST):
    """A literal written with `dict(key=...)` calls too (what ast.literal_eval does not read)."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict" and not node.args:
        return {k.arg: _literal(k.value) for k in node.keywords}
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


def write_adapter(folder: str, shape: dict, rank: int, seed: int) -> str:
    """A PEFT LoRA folder for `shape` (BUILTIN_SHAPES' keys) with random weights (A and B of standard deviation
    0.01, lora_alpha = 2 * rank) on every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    dims = {  # module: (in, out)
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for module, (fan_in, fan_out) in dims.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def write_adapters(folder: str, shape: dict, rank: int, count: int) -> list[str]:
    """`count` adapters a0, a1, ... (seed i for a{i}) under `folder`: their paths, in order."""
    return [write_adapter(os.path.join(folder, f"a{i}"), shape, rank, i) for i in range(count)]
