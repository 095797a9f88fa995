"""Build a model and fill its weights: from a Hugging Face folder (safetensors) or as dummy weights."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from typing import Iterator, Optional

import torch

from ..models import model_class
from ..models.config import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..models.parallel import ModelParallel, read_slice
from ..quant.checkpoint import fp8_layers_for_checkpoint

# (what a folder holds is read in model_files.py, which the engine process imports without torch)
from .model_files import check_is_folder, load_model_config, load_tokenizer  # noqa: F401

logger = logging.getLogger("plait.model_loader")


def safetensors_files(model_path: str) -> list[str]:
    """The folder's weight files, each checked readable: the shards its model.safetensors.index.json
    names (other *.safetensors files, e.g. Mistral's consolidated.safetensors, are another format),
    else model.safetensors, else every *.safetensors."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            try:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as e:
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_path, s))]
        if missing:
            raise ValueError(
                f"{len(missing)} of the {len(shards)} weight shards that {index} lists are not in the "
                f"folder: {missing[:3]} (an interrupted download or copy?)"
            )
        files = [os.path.join(model_path, s) for s in shards]
    elif os.path.isfile(os.path.join(model_path, "model.safetensors")):
        files = [os.path.join(model_path, "model.safetensors")]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(_no_weights_message(model_path))
    for file in files:
        _check_readable(file)
    return files


def _check_readable(file: str) -> None:
    from safetensors import safe_open

    try:
        # NOTE: opening reads and checks the header, which covers the file's exact length: a truncated
        # file fails here, before the model is built, not midway through loading it.
        with safe_open(file, framework="pt"):
            pass
    except Exception as e:
        raise ValueError(
            f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); it may be "
            f"truncated or corrupt: copy or save it again"
        ) from None


def _no_weights_message(model_path: str) -> str:
    names = sorted(os.listdir(model_path))
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth")) and not n.startswith("training_args")]
    ggufs = [n for n in names if n.endswith(".gguf")]
    head = f"no weights (*.safetensors) in model folder {model_path!r}"
    if pickles:
        return (
            f"{head}, only {pickles[:3]}: plait reads safetensors, not PyTorch pickle files. Convert once with "
            f"transformers: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder) "
            f"(it writes model.safetensors)"
        )
    if ggufs:
        return (
            f"{head}, only {ggufs[:3]}: plait does not read GGUF. Convert once with transformers: "
            f"AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).save_pretrained(folder)"
        )
    return f"{head} (it holds {names[:8]}); load_format='dummy' runs the config with random weights"


def _iter_safetensors(files: list[str], model: Optional[torch.nn.Module] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, tensor) of what the model's rank holds, read straight from the files: on one device
    every tensor whole; split over ranks only this rank's slices (`model.checkpoint_read`), so no rank
    ever reads a tensor, or a layer, that is not its own. No model (a drafter's head, which names its
    own tensors): every tensor whole, under its file's name."""
    from safetensors import safe_open

    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if model is None:
                    yield name, st.get_tensor(name)
                    continue
                read = model.checkpoint_read(name)
                if read is not None:
                    yield read.name, read_slice(st, name, read)


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    # Small uniform weights keep activations finite through many bf16 layers; norms stay at 1.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            cpu = (
                torch.empty(p.shape, dtype=torch.float32).uniform_(-0.02, 0.02, generator=gen)
                if p.numel() < 2**24
                else None
            )
            if cpu is not None:
                p.copy_(cpu)
            else:  # large matrices: draw on the device (fast on a GPU)
                p.uniform_(-0.02, 0.02)


def _checkpoint_modules(module: str) -> list[str]:
    """A model module's name -> the checkpoint modules it holds (HF's names): a fused QKV or gate-up is its
    parts (LlamaForCausalLM.FUSED_PARTS), a layer's modules are under "model."."""
    owner, _, attr = module.rpartition(".")
    parts = LlamaForCausalLM.FUSED_PARTS.get(attr, (attr,))
    prefix = "model." if module.startswith("layers.") else ""
    return [f"{prefix}{owner}.{part}" if owner else f"{prefix}{part}" for part in parts]


@contextlib.contextmanager
def _no_init(enabled: bool) -> Iterator[None]:
    """Linear and embedding layers built without their random init, when the checkpoint overwrites every
    weight anyway (`load_weights` refuses a checkpoint that misses one, and zeroes the padding rows of a
    vocabulary shard that no checkpoint fills).

    NOTE: the init (kaiming-uniform draws over freshly mapped memory) was a large part of a small model's
    start on the CPU (RESULTS.md, bench_startup); left alone, each page is written once, by the load."""
    if not enabled:
        yield
        return
    saved = torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda layer: None
    try:
        yield
    finally:
        torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters = saved


def load_model(
    model_path: str,
    cfg: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: str,
    max_position: int,
    seed: int = 0,
    parallel: Optional[ModelParallel] = None,
) -> LlamaForCausalLM:
    """The model (this rank's shard of it, split over ranks by `parallel`) with its weights."""
    cls = model_class(cfg)
    files = [] if load_format == "dummy" else safetensors_files(model_path)  # checked before the model is built
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # NOTE: on the CPU no device context: it sends every tensor op of the build through a Python
        # __torch_function__ hook (a large part of a small model's start), and the CPU is where tensors go anyway.
        place = contextlib.nullcontext() if torch.device(device).type == "cpu" else torch.device(device)
        with place, _no_init(load_format != "dummy"):
            model = cls(cfg, max_position, parallel)
    finally:
        torch.set_default_dtype(old)
    if load_format == "dummy":
        _fill_dummy(model, seed)  # (an FP8 config's dummy weights are quantized after: quantization fp8)
    else:
        if cfg.fp8_checkpoint is not None:  # its layers' FP8 codes and scales load as they are
            fp8_layers_for_checkpoint(model, cfg.fp8_checkpoint, dtype, _checkpoint_modules)
        model.load_weights(_iter_safetensors(files, model))
    if torch.device(device).type == "cuda":
        from ..models.layers import share_split_k_workspace

        share_split_k_workspace(model)  # one buffer for the decode matmul's split-K sums, not one per layer
    return model.eval()
