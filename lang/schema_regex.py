"""`build_regex_from_object`: a Pydantic model, a JSON schema dict or its text as a regex for `gen(regex=...)`,
the constraint plait's outlines backend would build for `json_schema=` (SGLang's programs write it this way)."""

from __future__ import annotations

import json
from typing import Any, Optional


def build_regex_from_object(obj: Any, whitespace_pattern: Optional[str] = None) -> str:
    """The regex of the JSON the schema allows. `obj`: a Pydantic model class, a dict or a JSON string.
    Whitespace between JSON tokens is any run of spaces, tabs and newlines; another `whitespace_pattern` is
    refused rather than ignored."""
    if whitespace_pattern is not None:
        raise NotImplementedError(
            "build_regex_from_object(whitespace_pattern=...) is not supported: plait allows any whitespace "
            "between JSON tokens; pass gen(json_schema=...) for a compact layout"
        )
    if isinstance(obj, type) and hasattr(obj, "model_json_schema"):
        schema_text = json.dumps(obj.model_json_schema())
    elif isinstance(obj, dict):
        schema_text = json.dumps(obj)
    elif isinstance(obj, str):
        schema_text = obj
    else:
        raise TypeError(f"build_regex_from_object takes a Pydantic model class, a dict or a JSON string, got {obj!r}")
    # NOTE: imported here: the outlines backend loads torch, which `import plait` must not.
    from plait.runtime.constrained.outlines_backend import json_schema_regex

    return json_schema_regex(schema_text)
