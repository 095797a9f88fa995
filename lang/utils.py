"""`plait.utils`: the helpers SGLang's scripts import from `sglang.utils` (reading JSONL data, dumping
program states, plain HTTP calls to a server, cached downloads), written for plait."""

from __future__ import annotations

import base64
import json
import os
import sys
import traceback
from typing import Any, Iterator, Optional, Sequence, Union


def read_jsonl(filename: str) -> Iterator[Any]:
    """Each line of a JSONL file as a value; lines starting with "#" are comments."""
    with open(filename) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            yield json.loads(line)


def dump_state_text(filename: str, states: Sequence[Any], mode: str = "w") -> None:
    """Write each program state's text (a str as it is), between numbered rules, to `filename`."""
    from .state import ProgramState

    with open(filename, mode) as f:
        for i, state in enumerate(states):
            text = state.text() if isinstance(state, ProgramState) else str(state)
            f.write(f"{'=' * 40} {i} {'=' * 40}\n{text}\n{'=' * 80}\n\n")


def http_request(
    url: str,
    json: Optional[Any] = None,
    stream: bool = False,
    api_key: Optional[str] = None,
    verify: Any = None,
    method: Optional[str] = None,
) -> Any:
    """A request to a server, POST with a JSON body or GET without one (or `method`); the response has
    `.status_code`, `.json()` and `.text` (an HTTP error status is returned, not raised)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    method = method or ("GET" if json is None else "POST")
    return requests.request(
        method, url, json=json, stream=stream, headers=headers, verify=True if verify is None else verify
    )


def download_and_cache_file(url: str, filename: Optional[str] = None) -> str:
    """The local copy of `url` (in /tmp under its last path segment unless `filename` names one): kept when
    it exists, else downloaded. Without a network the error says which file to put where."""
    if filename is None:
        filename = os.path.join("/tmp", url.rstrip("/").split("/")[-1])
    if os.path.exists(filename):
        return filename
    import requests

    try:
        response = requests.get(url, stream=True, timeout=30)
        response.raise_for_status()
    except requests.RequestException as e:
        raise RuntimeError(
            f"could not download {url} ({type(e).__name__}); without a network, put the file at {filename} "
            "and it is used as it is"
        ) from None
    partial = filename + ".part"
    with open(partial, "wb") as f:
        for chunk in response.iter_content(chunk_size=1 << 16):
            f.write(chunk)
    os.replace(partial, filename)  # a download cut short never passes for the cached file
    return filename


def encode_image_base64(image: Union[str, bytes]) -> str:
    """An image file's (or its bytes') base64 text."""
    if isinstance(image, str):
        with open(image, "rb") as f:
            image = f.read()
    return base64.b64encode(image).decode("ascii")


def get_exception_traceback() -> str:
    """The exception being handled, formatted as Python prints it."""
    return "".join(traceback.format_exception(*sys.exc_info()))


def is_same_type(values: Sequence[Any]) -> bool:
    """Whether every value has the first one's type."""
    return all(isinstance(v, type(values[0])) for v in values[1:]) if values else True


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    blocks = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
    return any(low <= cp <= high for low, high in blocks)


def find_printable_text(text: str) -> str:
    """The part of streamed text safe to print now: up to the last space (a word may still grow), all of it
    after a newline or a CJK character (which stands alone)."""
    if text.endswith("\n") or (text and _is_cjk(text[-1])):
        return text
    if len(text) > 1 and _is_cjk(text[-2]):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


def convert_json_schema_to_str(json_schema: Any) -> str:
    """A JSON schema (a dict, its text or a Pydantic model class) as text."""
    if isinstance(json_schema, dict):
        return json.dumps(json_schema)
    if isinstance(json_schema, str):
        return json_schema
    if isinstance(json_schema, type) and hasattr(json_schema, "model_json_schema"):
        return json.dumps(json_schema.model_json_schema())
    raise ValueError(f"cannot read {json_schema!r} as a JSON schema: give a dict, a string or a Pydantic class")


def print_highlight(text: Any) -> None:
    print(text)
