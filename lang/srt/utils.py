"""`sglang.srt.utils`: what frontend programs import from it."""

from plait.media import load_image

__all__ = ["load_image"]
