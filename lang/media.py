"""Images and video in programs: `image(...)` and `video(...)` append the chat template's image token to
the prompt and their sources to the program's images (each request carries them as `image_data`); a
video is its frames, each an image. `load_image` is SGLang's (`sglang.srt.utils.load_image`).

Images are read by the runtime (plait.runtime.multimodal: paths, bytes, base64, data: URLs, PIL images;
URLs refused: no network); the runtime loads with the first image (`import plait` stays light)."""

from __future__ import annotations

import base64
import io
from typing import Any


def video_frames(path: str, num_frames: int) -> list[Any]:
    """`num_frames` RGB PIL frames sampled evenly from the video at `path`."""
    from plait.runtime.multimodal.video import load_video_frames

    return load_video_frames(path, num_frames)


def load_image(image_file: Any) -> tuple[Any, tuple[int, int]]:
    """SGLang's `load_image`: (an RGB PIL image, its (width, height)) from a path, bytes, base64 or a
    data: URL (http(s) URLs are refused: no network)."""
    from plait.runtime.multimodal.images import load_image as runtime_load_image

    image = runtime_load_image(image_file)
    return image, image.size


def image_base64(source: Any) -> Any:
    """An image source as /generate's JSON can carry it: a PIL image or bytes as base64 PNG/bytes text;
    a path, data: URL or base64 text as it is."""
    if isinstance(source, (bytes, bytearray)):
        return base64.b64encode(bytes(source)).decode("ascii")
    if hasattr(source, "save") and hasattr(source, "size"):  # a PIL image (a video's frame)
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode("ascii")
    return source
