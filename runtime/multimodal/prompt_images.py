"""A prompt's images for a vision model: each placeholder expanded to its image's tokens, each image
loaded, preprocessed and hashed (in the engine's process, off the scheduler's loop)."""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from ..io_struct import ImageInput
from ..models.vision_config import LlavaVision
from .images import ImageError, image_hash, load_image
from .preprocess import ClipPreprocess

MAX_IMAGES_PER_REQUEST = 64  # a bound on the tower's work one request may ask for


class PromptImages:
    """The model's image facts (its image token, tokens per image, preprocessing) and `prepare`."""

    def __init__(self, vision: LlavaVision, preprocess: ClipPreprocess):
        self.image_token_id = vision.image_token_id
        self.tokens_per_image = vision.tokens_per_image
        self.preprocess = preprocess

    @classmethod
    def for_model(cls, model_path: Optional[str]) -> Optional["PromptImages"]:
        """The folder's image facts; None for a model that takes no images."""
        path = os.path.join(model_path or "", "config.json")
        if not model_path or not os.path.isfile(path):
            return None
        with open(path) as f:
            raw = json.load(f)
        if "LlavaForConditionalGeneration" not in (raw.get("architectures") or []) and raw.get("model_type") != "llava":
            return None
        vision = LlavaVision(raw)
        return cls(vision, ClipPreprocess.of_folder(model_path, vision.tower))

    def prepare(self, input_ids: list[int], image_data: Sequence[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(ids with each image's placeholder expanded, the images). A placeholder is a run of the image
        token: one token (expanded to the image's count) or already the image's count (kept)."""
        if len(image_data) > MAX_IMAGES_PER_REQUEST:
            raise ImageError(f"{len(image_data)} images in one request: at most {MAX_IMAGES_PER_REQUEST}")
        runs = _runs(input_ids, self.image_token_id)
        if len(runs) != len(image_data):
            raise ImageError(
                f"the prompt has {len(runs)} image placeholder(s) (token {self.image_token_id}) for "
                f"{len(image_data)} image(s): put one image token where each image goes"
            )
        n = self.tokens_per_image
        ids: list[int] = []
        images = []
        last = 0
        for k, ((start, length), source) in enumerate(zip(runs, image_data)):
            if length not in (1, n):
                raise ImageError(f"image placeholder {k} is {length} image tokens: give 1 (or exactly {n})")
            image = load_image(source, f"image_data[{k}]")
            ids.extend(input_ids[last:start])
            images.append(ImageInput(len(ids), n, self.preprocess(image), image_hash(image)))
            ids.extend([self.image_token_id] * n)
            last = start + length
        ids.extend(input_ids[last:])
        return ids, tuple(images)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in ids."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
