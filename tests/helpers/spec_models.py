"""Small random draft models and EAGLE heads for speculative-decoding tests, written as Hugging Face folders
(config.json + safetensors) next to a random target from conftest.make_random_model."""

from __future__ import annotations

import json
import os

import torch


def write_eagle_head(folder: str, target_folder: str, kind: str, seed: int = 0, draft_vocab: int = 0) -> str:
    """A random EAGLE ("EAGLE") or EAGLE-3 ("EAGLE3") head for the target, under the weight names of
    published heads (no embedding: the target's is used). EAGLE-3 reads the target's layers 0, 0 and 1
    (the inputs of layers 1, 1 and 2: the last layer's output before the final norm)."""
    from safetensors.torch import save_file

    with open(os.path.join(target_folder, "config.json")) as f:
        t = json.load(f)
    h, inter, heads, kv = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d = h // heads
    vocab = t["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).contiguous()

    cfg = {
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": t["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": t.get("rope_theta", 10000.0),
        "tie_word_embeddings": False,
    }
    in_dim = h if kind == "EAGLE" else 2 * h
    prefix = "layers.0." if kind == "EAGLE" else "midlayer."
    weights = {
        f"{prefix}self_attn.q_proj.weight": w(heads * d, in_dim),
        f"{prefix}self_attn.k_proj.weight": w(kv * d, in_dim),
        f"{prefix}self_attn.v_proj.weight": w(kv * d, in_dim),
        f"{prefix}self_attn.o_proj.weight": w(h, heads * d),
        f"{prefix}mlp.gate_proj.weight": w(inter, h),
        f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h),
    }
    if kind == "EAGLE":
        cfg["architectures"] = ["LlamaForCausalLMEagle"]
        weights |= {"fc.weight": w(h, 2 * h), "fc.bias": w(h)}
    else:
        dv = draft_vocab or vocab
        cfg |= {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": dv,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]},
        }
        # the draft vocabulary: every other target id (d2t holds target id - draft id)
        target_ids = torch.arange(dv) * (vocab // dv)
        weights |= {
            "fc.weight": w(h, 3 * h),
            "norm.weight": torch.ones(h),
            "lm_head.weight": w(dv, h),
            f"{prefix}input_layernorm.weight": torch.ones(h),
            f"{prefix}hidden_norm.weight": torch.ones(h),
            "d2t": target_ids - torch.arange(dv),
            "t2d": torch.zeros(vocab, dtype=torch.bool),
        }
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder
