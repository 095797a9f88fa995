"""CLIP's image preprocessing (what a LLaVA folder's preprocessor_config.json asks for): the shortest
edge resized (bicubic, by Pillow), a center crop, rescaled to [0, 1], normalized per channel. Each step
as transformers' CLIPImageProcessor computes it, so a model sees the pixels it was trained on."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np

from ..models.vision_config import ClipVisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's resample code, transformers' default for CLIP


class ClipPreprocess:
    def __init__(self, cfg: dict[str, Any], tower: ClipVisionConfig):
        size = cfg.get("size", {"shortest_edge": tower.image_size})
        self.shortest_edge: Optional[int] = (
            (size.get("shortest_edge") if isinstance(size, dict) else int(size)) if cfg.get("do_resize", True) else None
        )
        crop = cfg.get("crop_size", {"height": tower.image_size, "width": tower.image_size})
        crop = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
        self.crop: Optional[tuple[int, int]] = crop if cfg.get("do_center_crop", True) else None
        self.resample = cfg.get("resample", BICUBIC)
        self.rescale = cfg.get("rescale_factor", 1 / 255) if cfg.get("do_rescale", True) else None
        self.normalize = cfg.get("do_normalize", True)
        self.mean = np.asarray(cfg.get("image_mean", CLIP_MEAN), dtype=np.float32)  # (C,)
        self.std = np.asarray(cfg.get("image_std", CLIP_STD), dtype=np.float32)  # (C,)
        self.image_size = tower.image_size

    @classmethod
    def of_folder(cls, model_path: str, tower: ClipVisionConfig) -> "ClipPreprocess":
        path = os.path.join(model_path, "preprocessor_config.json")
        cfg: dict[str, Any] = {}
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
        return cls(cfg, tower)

    def __call__(self, image: Any) -> np.ndarray:
        """An RGB PIL image -> (3, S, S) float32 pixels, S the tower's image size."""
        if self.shortest_edge is not None:
            width, height = image.size
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(self.shortest_edge * long / short)
            new_w, new_h = (self.shortest_edge, new_long) if width <= height else (new_long, self.shortest_edge)
            if (new_w, new_h) != image.size:
                image = image.resize((new_w, new_h), resample=self.resample, reducing_gap=None)
        pixels = np.asarray(image, dtype=np.uint8)  # (H, W, 3)
        if self.crop is not None:
            height, width = pixels.shape[:2]
            ch, cw = self.crop
            if height < ch or width < cw:
                raise ValueError(f"an image of {width}x{height} is smaller than the {cw}x{ch} crop after resizing")
            top, left = (height - ch) // 2, (width - cw) // 2
            pixels = pixels[top : top + ch, left : left + cw]
        if pixels.shape[:2] != (self.image_size, self.image_size):
            raise ValueError(
                f"preprocessing gives {pixels.shape[1]}x{pixels.shape[0]} pixels; the vision tower takes "
                f"{self.image_size}x{self.image_size} (preprocessor_config.json and config.json disagree)"
            )
        out = pixels.astype(np.float64) * self.rescale if self.rescale is not None else pixels.astype(np.float64)
        out = out.astype(np.float32)  # (S, S, 3)
        if self.normalize:
            out = (out - self.mean) / self.std
        return np.ascontiguousarray(out.transpose(2, 0, 1))  # (3, S, S)
