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
        """(ids with each image's placeholder expanded, the images). The prompt holds the image token once
        per image (each expanded to the image's tokens), or already the image's count per image (kept)."""
        if len(image_data) > MAX_IMAGES_PER_REQUEST:
            raise ImageError(f"{len(image_data)} images in one request: at most {MAX_IMAGES_PER_REQUEST}")
        token, n = self.image_token_id, self.tokens_per_image
        positions = [i for i, t in enumerate(input_ids) if t == token]
        if len(positions) == len(image_data) * n and n > 1:
            width = n  # expanded already (a prompt from the OpenAI route or a retry): image k is run k
        elif len(positions) == len(image_data):
            width = 1
        else:
            raise ImageError(
                f"the prompt has {len(positions)} image token(s) (id {token}) for {len(image_data)} image(s): "
                f"put one image token where each image goes"
            )
        ids: list[int] = []
        images = []
        last = 0
        for k, source in enumerate(image_data):
            start = positions[k * width]
            if positions[k * width + width - 1] != start + width - 1:
                raise ImageError(f"image {k}'s {width} tokens are not consecutive in the prompt")
            image = load_image(source, f"image_data[{k}]")
            ids.extend(input_ids[last:start])
            images.append(ImageInput(len(ids), n, self.preprocess(image), image_hash(image)))
            ids.extend([token] * n)
            last = start + width
        ids.extend(input_ids[last:])
        return ids, tuple(images)
