"""Engine outputs → OpenAI response and stream-chunk bodies (completions and chat).

The Engine reports logprobs as lists of `(logprob, token_id, text)` and finish reasons as
`{"type": "stop" | "length" | "abort", ...}`; this module reshapes them into OpenAI's formats.
Streaming state (what each choice has sent, and its text so far for the tool-call parser, which reads it
whole) lives in `ChoiceCursor`; the Engine's chunks are deltas, as OpenAI's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


def finish_reason(meta: dict[str, Any]) -> Optional[str]:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    return kind if kind in ("stop", "length", "abort") else "stop"


def abort_error(meta: dict[str, Any]) -> Optional[tuple[int, str]]:
    """(status, message) when the Engine aborted the request with a reason (a grammar it could not
    compile, an internal failure, an operator's /abort_request). OpenAI has no "abort" finish
    reason, so OpenAI clients get an error instead of an empty 200."""
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") != "abort":
        return None
    message = str(fr.get("message") or "aborted")
    status = fr.get("status_code") or (400 if message.startswith("invalid") else 500)
    return int(status), f"request aborted: {message}"


def matched_stop(meta: dict[str, Any]) -> Any:
    fr = meta.get("finish_reason")
    return fr.get("matched") if isinstance(fr, dict) else None


def usage(prompt_metas: list[dict[str, Any]], all_metas: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI usage: each distinct prompt counted once (n samples share it), completions summed."""
    prompt = sum(int(m.get("prompt_tokens") or 0) for m in prompt_metas)
    cached = sum(int(m.get("cached_tokens") or 0) for m in prompt_metas)
    completion = sum(int(m.get("completion_tokens") or 0) for m in all_metas)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---------------------------------------------------------------- logprobs


def _entries(meta: dict[str, Any], key: str) -> list:
    return list(meta.get(key) or [])


def _token_text(entry: Any, tokenizer: Any) -> str:
    logprob, token_id, text = (list(entry) + [None, None, None])[:3]
    if text is None and tokenizer is not None and token_id is not None:
        text = tokenizer.decode([token_id])
    return text or ""


def _top_dict(tops: Any, tokenizer: Any) -> Optional[dict[str, float]]:
    if tops is None:
        return None
    return {_token_text(t, tokenizer): float(t[0]) for t in tops}


def completion_logprobs(tokens: list, tops: list, tokenizer: Any, text_offset: int) -> dict[str, Any]:
    """`choices[i].logprobs` of /v1/completions for a slice of token entries."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for k, entry in enumerate(tokens):
        text = _token_text(entry, tokenizer)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry[0] is None else float(entry[0]))
        top = _top_dict(tops[k] if k < len(tops) else None, tokenizer)
        if entry[0] is not None:
            # OpenAI (and vLLM): the chosen token is always among its position's top_logprobs, so there
            # are up to logprobs + 1 entries, and logprobs=0 still gives one (harnesses read max(top)).
            top = top or {}
            top.setdefault(text, float(entry[0]))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(
    tokens: list, tops: list, tokenizer: Any, token_bytes: Optional[Callable[[Optional[int], str], bytes]] = None
) -> dict[str, Any]:
    """`choices[i].logprobs` of /v1/chat/completions for a slice of token entries. `token_bytes` gives a
    token's raw bytes (openai/token_bytes.py's TokenBytes); without it, those of its text."""

    def item(entry: Any) -> dict[str, Any]:
        text = _token_text(entry, tokenizer)
        raw = token_bytes(entry[1], text) if token_bytes is not None else text.encode("utf-8")
        return {"token": text, "logprob": float(entry[0]), "bytes": list(raw)}

    content = []
    for k, entry in enumerate(tokens):
        top = tops[k] if k < len(tops) and tops[k] is not None else []
        content.append({**item(entry), "top_logprobs": [item(x) for x in top]})
    return {"content": content}


# ---------------------------------------------------------------- streaming cursors


@dataclass
class ChoiceCursor:
    """What one choice has sent in a stream, and its text so far."""

    text: str = ""
    role_sent: bool = False
    finished: bool = False
    text_offset: int = 0

    def text_delta(self, chunk: dict[str, Any]) -> str:
        """The Engine's next chunk's new text (added to `text`, which drops what a stop regex cut off the
        end: a stream cannot take back what it sent, but the tool-call parser reads the final text)."""
        offset = chunk.get("text_offset")
        if offset is not None and offset < len(self.text):
            self.text = self.text[:offset]
        delta = chunk.get("text") or ""
        self.text += delta
        return delta

    @staticmethod
    def logprob_delta(meta: dict[str, Any]) -> tuple[list, list]:
        """The next chunk's output logprobs and their top lists."""
        return _entries(meta, "output_token_logprobs"), _entries(meta, "output_top_logprobs")
