"""An image from whatever a user hands over: a PIL image, bytes, a file path, a data: URL or base64 text.

http(s) URLs are refused: the runtime fetches nothing over the network (a server answering requests
must not be made to download what a request names); the caller downloads and passes the bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from typing import Any

import numpy as np

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # refuses decompression bombs before decoding the pixels


class ImageError(ValueError):
    """An image that cannot be used (its message says why): a 400 over HTTP."""


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency
        raise ImageError("images need Pillow: pip install pillow") from None
    return Image


def load_image(source: Any, what: str = "image") -> Any:
    """`source` -> an RGB PIL image. `what` names the source in errors (e.g. "image_data[1]")."""
    Image = _pil()
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, dict):  # OpenAI's {"url": ...} and SGLang's {"image": ...} shapes
        inner = source.get("url", source.get("image"))
        if inner is None:
            raise ImageError(f"{what} is a dict without a 'url': {sorted(source)[:4]}")
        return load_image(inner, what)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), what)
    if not isinstance(source, str):
        raise ImageError(
            f"{what} must be a PIL image, bytes, a path, a data: URL or base64, got {type(source).__name__}"
        )
    text = source.strip()
    lower = text[:16].lower()
    if lower.startswith(("http://", "https://")):
        raise ImageError(
            f"{what} is a URL ({text[:60]}): plait has no network access for images; download it and pass "
            f"the bytes, a file path or a data: URL (base64)"
        )
    if lower.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or ";base64" not in header:
            raise ImageError(f"{what} is a data: URL without base64 data ('data:image/png;base64,...')")
        return _decode(_b64(payload, what), what)
    if lower.startswith("file://"):
        text = text[len("file://") :]
    if len(text) < 4096 and os.path.isfile(text):
        with open(text, "rb") as f:
            return _decode(f.read(), what)
    if len(text) < 256 and ("/" in text or "." in text[-6:]):
        raise ImageError(f"{what}: no such file {text!r}")
    return _decode(_b64(text, what), what)


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what} is neither a file path, a data: URL nor valid base64") from None


def _decode(data: bytes, what: str) -> Any:
    Image = _pil()
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ImageError(f"{what} is {width}x{height}: over the {MAX_IMAGE_PIXELS} pixels plait decodes")
        image.load()
    except ImageError:
        raise
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise ImageError(f"{what} is not a readable image ({len(data)} bytes: {type(e).__name__}: {e})") from None
    return image.convert("RGB")


def image_hash(image: Any) -> int:
    """A 63-bit hash of an RGB image's size and pixels: equal images, however they came, hash alike."""
    digest = hashlib.blake2b(repr(image.size).encode(), digest_size=8)
    digest.update(np.asarray(image, dtype=np.uint8).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1
