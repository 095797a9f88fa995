"""vLLM's `structured_outputs` request field → SamplingParams constraint fields, so clients written for
vLLM (`extra_body={"structured_outputs": {"choice": [...]}}`) get the same constrained output here."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from ..errors import APIError
from ..protocol.openai import StructuredOutputs
from .response_format import ANY_JSON_OBJECT_SCHEMA


def structured_outputs_to_sampling(so: Optional[StructuredOutputs]) -> dict[str, Any]:
    """The constraint `so` asks for (empty for none); a 400 for two at once, as vLLM refuses them."""
    if so is None:
        return {}
    asked = {
        name: value
        for name, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        )
        if value is not None
    }
    if len(asked) > 1:
        raise APIError(
            400, f"structured_outputs asks for {' and '.join(asked)}: give one constraint", param="structured_outputs"
        )
    if not asked:
        return {}
    ((kind, value),) = asked.items()
    if kind == "json":
        return {"json_schema": value if isinstance(value, str) else json.dumps(value)}
    if kind == "json_object":
        return {"json_schema": ANY_JSON_OBJECT_SCHEMA}
    if kind == "choice":
        return {"regex": "(" + "|".join(re.escape(c) for c in value) + ")"}
    return {"regex": value} if kind == "regex" else {"ebnf": value}
