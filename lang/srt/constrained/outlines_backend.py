"""`sglang.srt.constrained.outlines_backend`: `build_regex_from_object`, as SGLang's programs import it."""

from plait.schema_regex import build_regex_from_object

__all__ = ["build_regex_from_object"]
