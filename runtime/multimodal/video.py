"""A video as frames sampled from a file, for a model that sees a video as a sequence of images.

Animated GIF/WebP/APNG files are read by Pillow (a dependency already); other containers (mp4, webm,
...) need PyAV (`pip install av`), which is used when installed and otherwise named in a clear error:
no heavy video stack is a dependency of plait.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .images import ImageError

_PILLOW_VIDEO = (".gif", ".webp", ".png", ".apng")


def sample_indices(total: int, num_frames: int) -> list[int]:
    """`num_frames` frame indices spread evenly over `total` frames, first and last included (every
    frame, once each, when the file has no more than that)."""
    if num_frames <= 0:
        raise ImageError(f"num_frames must be positive, got {num_frames}")
    if total <= num_frames:
        return list(range(total))
    return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()


def load_video_frames(path: str, num_frames: int) -> list[Any]:
    """Up to `num_frames` RGB PIL frames of the video at `path`, evenly spaced."""
    if not isinstance(path, str) or not os.path.isfile(path):
        if isinstance(path, str) and path.lower().startswith(("http://", "https://")):
            raise ImageError(f"video {path[:60]} is a URL: plait has no network access; download it first")
        raise ImageError(f"video: no such file {path!r}")
    if path.lower().endswith(_PILLOW_VIDEO):
        return _pillow_frames(path, num_frames)
    try:
        import av  # type: ignore[import-not-found]
    except ImportError:
        raise ImageError(
            f"video {os.path.basename(path)!r}: reading this container needs PyAV (pip install av); "
            f"animated GIF/WebP/PNG files are read without it"
        ) from None
    with av.open(path) as container:
        frames = [frame.to_image() for frame in container.decode(video=0)]
    if not frames:
        raise ImageError(f"video {os.path.basename(path)!r} has no frames")
    return [frames[i].convert("RGB") for i in sample_indices(len(frames), num_frames)]


def _pillow_frames(path: str, num_frames: int) -> list[Any]:
    from PIL import Image

    try:
        with Image.open(path) as video:
            total = getattr(video, "n_frames", 1)
            frames = []
            for i in sample_indices(total, num_frames):
                video.seek(i)
                frames.append(video.convert("RGB"))
    except Exception as e:
        raise ImageError(f"video {os.path.basename(path)!r} is not readable ({type(e).__name__}: {e})") from None
    return frames
