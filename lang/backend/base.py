"""The interface every backend implements for the interpreter.

`s` below is the program's `StreamExecutor`: backends read `s.text_` (the prompt so far),
`s.messages_` (chat backends) and `s.cur_role`. Methods that a backend cannot do raise
NotImplementedError with the reason.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Union

from ..chat_template import ChatTemplate, get_chat_template
from ..choices import ChoicesDecision, ChoicesSamplingMethod
from ..gen_params import ResolvedGen


class BaseBackend:
    is_chat_model = False

    def __init__(self, chat_template: Optional[ChatTemplate] = None) -> None:
        self.chat_template = chat_template or get_chat_template("default")

    def get_model_name(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no model name")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # ---- program lifecycle and prefix hints (no-ops unless the backend can use them) ----
    def begin_program(self, s: Any) -> None:
        pass

    def end_program(self, s: Any) -> None:
        pass

    def cache_prefix(self, prefix: str) -> None:
        """Prefill `prefix` so later requests that start with it reuse its KV cache."""

    def commit_lazy_operations(self, s: Any) -> None:
        """Called before a fork: the text so far becomes a cached prefix the branches share."""
        self.cache_prefix(s.text_)

    def pin_prefix(self, prefix: str) -> Any:
        """Keep `prefix` cached while forked branches still need it; returns a handle or None."""
        return None

    def unpin_prefix(self, handle: Any) -> None:
        pass

    # ---- generation ----
    def generate(self, s: Any, params: ResolvedGen) -> tuple[Union[str, list[str]], Union[dict, list[dict]]]:
        """Generate after `s.text_`: (text, meta_info), or lists of them when params.sampling.n > 1."""
        raise NotImplementedError(f"{type(self).__name__} cannot generate")

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        """Yield (new text piece, meta_info so far) as the model generates."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream")

    def select(self, s: Any, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__} cannot select")

    # ---- runtime management ----
    def flush_cache(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no cache to flush")

    def get_server_info(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} has no server info")

    def shutdown(self) -> None:
        pass
