"""What the hosted chat-API backends (Anthropic, LiteLLM, VertexAI) share: the conversation a program has
written, the sampling settings those APIs take, a clear refusal of what they cannot do (a gen's regex or
JSON schema, logprobs, n > 1, select), and their SDK imported only when a backend is built."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from ..gen_params import ResolvedGen


def import_sdk(module: str, backend: str, package: str) -> Any:
    """The SDK module, or an ImportError that says which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"plait.{backend} needs the {package!r} package: pip install {package}") from e


def conversation(s: Any) -> tuple[Optional[str], list[dict]]:
    """(the system prompt or None, the other turns as {"role", "content"}) of what the program wrote.

    A gen inside an open assistant turn continues that turn; a program with no roles at all is one user
    turn of its text (as SGLang sends it)."""
    messages = [dict(m) for m in s.messages_]
    if not messages:
        return None, [{"role": "user", "content": s.text_}]
    system = messages.pop(0)["content"] if messages[0]["role"] == "system" else None
    if s.cur_role == "assistant":
        partial = s.text_[s.cur_role_begin_pos :]
        if partial.strip():
            messages.append({"role": "assistant", "content": partial})
    return system, messages


def refuse_unsupported(backend: str, params: ResolvedGen) -> None:
    """Raise for what the hosted APIs cannot honour, rather than sending a request that ignores it."""
    sp = params.sampling
    kind = params.constraint()
    if kind is not None:
        raise NotImplementedError(
            f"{backend} cannot constrain a gen's output ({kind}); use plait's Runtime or a RuntimeEndpoint"
        )
    if sp.n > 1:
        raise NotImplementedError(f"{backend} does not take gen(n > 1); fork the state instead")
    if params.options.return_logprob:
        raise NotImplementedError(f"{backend} returns no token logprobs")
    if params.options.lora_path is not None:
        raise NotImplementedError(f"{backend} serves no LoRA adapters (gen's or run's lora)")


def stop_list(params: ResolvedGen) -> list[str]:
    return list(params.sampling.stop_strs or [])


def top_k(params: ResolvedGen) -> Optional[int]:
    return params.sampling.top_k if params.sampling.top_k > 0 else None
