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
from ..pins import PinService, PrefixPin


class BaseBackend:
    is_chat_model = False
    # Program hints (plait's additions to SGLang's frontend): scheduling group tags on requests,
    # prefix pins for forks and program state, run_batch's shared-segment prefill. Turn them off
    # (`backend.program_hints = False`) to send exactly what SGLang's frontend sends.
    program_hints = True

    def __init__(self, chat_template: Optional[ChatTemplate] = None) -> None:
        self.chat_template = chat_template or get_chat_template("default")
        self._pin_service: Optional[PinService] = None

    def get_model_name(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no model name")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # ---- program lifecycle and prefix hints (no-ops unless the backend can use them) ----
    def begin_program(self, s: Any) -> None:
        pass

    def end_program(self, s: Any) -> None:
        pass

    def prefix_cache_enabled(self) -> bool:
        """Whether the runtime keeps a prefix cache (prefilling or pinning a prefix pays off)."""
        return False

    def hints_enabled(self) -> bool:
        return bool(self.program_hints) and self.prefix_cache_enabled()

    def kv_pool_tokens(self) -> Optional[int]:
        """The runtime's KV pool size in tokens, when known (it bounds what programs may pin)."""
        return None

    def kv_free_tokens(self) -> Optional[int]:
        """Free slots in the runtime's KV pool now, when it says (a pin is worth its call only when short)."""
        return None

    def vocab_size(self) -> Optional[int]:
        """The runtime's vocabulary size, when this process knows it: each gen's sampling parameters are
        checked against it once, where the program writes the gen (token ids included)."""
        return None

    def tokenize(self, text: str) -> Optional[list[int]]:
        """The token ids the runtime will see for `text`, when this process can know them."""
        return None

    def cache_prefix(self, prefix: Union[str, list[int]]) -> Optional[dict]:
        """Prefill `prefix` so later requests that start with it reuse its KV cache; returns the
        request's meta_info ({"prompt_tokens", "cached_tokens", ...}) when the runtime reports one."""
        return None

    def cache_prefixes(self, prefixes: Sequence[Union[str, list[int]]]) -> list[Optional[dict]]:
        """Prefill several prefixes (one batched request where the runtime takes batches)."""
        return [self.cache_prefix(p) for p in prefixes]

    def commit_lazy_operations(self, s: Any) -> None:
        """Called before a fork: the text so far becomes a cached prefix the branches share."""
        self.cache_prefix(s.text_)

    def pin_prefix(self, prefix: Union[str, list[int]]) -> Optional[PrefixPin]:
        """Lock the cached part of `prefix` against eviction until `unpin_prefix`; None when the
        runtime cannot pin."""
        return None

    def unpin_prefix(self, pin: PrefixPin) -> None:
        pass

    def pin_service(self) -> PinService:
        """The thread pool and token budget of this backend's program pins (see plait.pins)."""
        if getattr(self, "_pin_service", None) is None:
            self._pin_service = PinService(self)
        return self._pin_service

    def check_api_speculation(self, num_api_spec_tokens: int) -> None:
        """`@function(num_api_spec_tokens=N)`: SGLang's API speculative execution, one request for a whole
        assistant turn of an API chat model. A backend with a runtime behind it has no round trips to save:
        the setting is unused, as in SGLang. A backend that would need it and cannot honour it raises."""

    # ---- generation ----
    def generate(self, s: Any, params: ResolvedGen) -> tuple[Union[str, list[str]], Union[dict, list[dict]]]:
        """Generate after `s.text_`: (text, meta_info), or lists of them when params.sampling.n > 1."""
        raise NotImplementedError(f"{type(self).__name__} cannot generate")

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        """Yield (new text piece, meta_info so far) as the model generates."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream")

    def select(
        self, s: Any, choices: Sequence[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__} cannot select")

    # ---- runtime management ----
    def flush_cache(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no cache to flush")

    def get_server_info(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} has no server info")

    def shutdown(self) -> None:
        pass

    def is_shutting_down(self) -> bool:
        """Whether `shutdown()` has begun: a program still running then fails because its runtime went away,
        not because of anything in the program (the interpreter does not log those failures)."""
        return False
