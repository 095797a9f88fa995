"""Images and video in programs: not served yet. One place says so, for `image()`, `video()` and
`plait.srt.utils.load_image`, so every way in fails the same way, at once, naming what is missing."""

from __future__ import annotations

from typing import Any, NoReturn


def unsupported_media(what: str) -> NoReturn:
    """Raise the one NotImplementedError for multimodal inputs (plait issue 37: a vision-language model
    family is still to come)."""
    raise NotImplementedError(
        f"{what} is not supported: plait's runtime serves text-only models (no multimodal inputs: "
        "images, video); vision-language models are plait issue 37"
    )


def load_image(image_file: Any) -> NoReturn:
    """SGLang's `load_image` (an image from a path, URL, bytes or base64): there is no model to hand one to."""
    unsupported_media("load_image()")
