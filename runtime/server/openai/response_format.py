"""OpenAI `response_format` → SamplingParams constraint fields.

This is the one place the HTTP layer maps structured-output requests onto constrained decoding.
The schema itself is validated and compiled by the grammar backend (runtime/constrained/): a schema it
cannot compile comes back from the Engine as a ValueError, which the server turns into a 400. So does,
with `strict: true`, a schema keyword the backend cannot enforce exactly (the error names the keyword and
its JSON path): strict promises an output that matches the schema.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..protocol.openai import ResponseFormat

# `{"type": "json_object"}` means "any JSON object"; OpenAI does not constrain it further.
ANY_JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})


def response_format_to_sampling(rf: Optional[ResponseFormat]) -> dict[str, Any]:
    """SamplingParams fields for a response_format (empty for none / `text`)."""
    if rf is None or rf.type == "text":
        return {}
    if rf.type == "json_object":
        return {"json_schema": ANY_JSON_OBJECT_SCHEMA}
    assert rf.json_schema is not None and rf.json_schema.schema_ is not None  # checked by the model
    params: dict[str, Any] = {"json_schema": json.dumps(rf.json_schema.schema_)}
    if rf.json_schema.strict:
        params["strict"] = True
    return params
