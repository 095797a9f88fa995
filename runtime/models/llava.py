"""LLaVA (1.5 style): a CLIP vision tower, a two-layer projector, and the Llama decoder of llama.py.

Why LLaVA first (issue 37): its decoder is plait's Llama unchanged (plain 1-D rotary positions, so the
KV cache, attention backends, CUDA graphs and speculation need nothing new), and its vision side is a
plain ViT run on whole images; Qwen2-VL's 3-D rotary positions would touch every attention path.

A prompt holds the image token (`image_token_index`) once per patch feature of each image (the engine
expands each placeholder: runtime/multimodal/). A prefill step carries, for the rows of its chunks that
are image tokens, the image's pixels (`ForwardBatch.images`: `step.ImageRows`); the decoder's input
embeddings at those rows are the projected tower features instead of the token's embedding. Decode steps
carry none, so decode (and its CUDA graphs) is the Llama decoder's as it is.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn as nn

from ..forward_batch import ForwardBatch
from ..uploads import to_device
from .clip import ClipVisionModel, activation
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .parallel import CheckpointRead, ModelParallel
from .vision_config import LlavaVision
from .weights import copy_checked

_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def checkpoint_name(name: str) -> str:
    """A LLaVA checkpoint name (`language_model.model.*` or `model.language_model.*`, the tower with or
    without its `vision_model.` level)
    -> the name plait's modules use: the decoder's as a Llama checkpoint names them, the tower's and
    projector's under `vision_tower.` / `multi_modal_projector.`."""
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        # transformers 5 saves the tower's transformer itself (no `vision_model.` level)
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_position: int, parallel: Optional[ModelParallel] = None):
        parallel = parallel or ModelParallel.single()
        if parallel.tp.size > 1 or parallel.stage.num_layers >= 0:
            raise ValueError("a vision-language model runs on one device in plait (tp_size = pp_size = 1)")
        super().__init__(cfg, max_position, parallel)
        self.vision = vision = LlavaVision(cfg.raw)
        self.vision_tower = ClipVisionModel(vision.tower)
        self.multi_modal_projector = LlavaProjector(
            vision.tower.hidden_size * len(vision.feature_layers),
            cfg.hidden_size,
            vision.projector_act,
            vision.projector_bias,
        )

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (N, C, S, S) -> (N, tokens per image, hidden): what each image token's row embeds."""
        states = self.vision_tower.hidden_states(pixels, self.vision.feature_layers)  # each (N, 1 + P, vision hidden)
        if self.vision.feature_strategy == "default":
            states = [s[:, 1:] for s in states]  # the class token dropped
        return self.multi_modal_projector(torch.cat(states, dim=-1))  # (N, tokens, hidden)

    def _decoder(self, input_ids, positions, fb: ForwardBatch, carried=None):
        if carried is None and fb.images:
            h = self.embed_tokens(input_ids)  # (T, hidden)
            carried = (self._splice_images(h, fb.images), None)
        return super()._decoder(input_ids, positions, fb, carried)

    def _splice_images(self, h: torch.Tensor, images: list) -> torch.Tensor:
        """h (T, hidden) with each `step.ImageRows`' rows replaced by its image's features; an image the
        step carries twice (two requests, or two chunks) runs through the tower once."""
        keys: dict[int, int] = {}
        pixels = []
        for item in images:
            if item.key not in keys:
                keys[item.key] = len(pixels)
                pixels.append(item.pixels)
        batch = to_device(torch.from_numpy(np.stack(pixels)), h.device)  # (N, C, S, S) float32, queued
        feats = self.image_features(batch).to(h.dtype)  # (N, tokens, hidden)
        for item in images:
            h[item.row : item.row + item.count] = feats[keys[item.key], item.start : item.start + item.count]
        return h

    # ---- weights ----
    def text_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.named_parameters() if not n.startswith(_VISION_PREFIXES))

    def checkpoint_read(self, name: str) -> Optional[CheckpointRead]:
        name = checkpoint_name(name)
        if name.startswith(_VISION_PREFIXES):
            return CheckpointRead(name)
        return super().checkpoint_read(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors through the Llama loader; the tower's and projector's here, each checked."""
        own = {n: p for n, p in self.named_parameters() if n.startswith(_VISION_PREFIXES)}
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                name = checkpoint_name(name)
                if not name.startswith(_VISION_PREFIXES):
                    yield name, tensor
                elif name.endswith("position_ids"):
                    continue  # a buffer older transformers saved
                elif name not in own:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint: this LLaVA config has no such weight")
                else:
                    copy_checked(own[name].data, tensor, name)
                    loaded.add(name)

        super().load_weights(text_weights())
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision weight(s), e.g. {missing[:3]}")
