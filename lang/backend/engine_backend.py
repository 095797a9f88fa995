"""The colocated backend: programs call the in-process Engine directly (no HTTP).

`plait.Runtime(model_path=None, **server_args)` starts an Engine in this process (the embedded
default model when model_path is None) and exposes it as `.endpoint`, an EngineBackend, the way
SGLang's Runtime exposes a RuntimeEndpoint.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from typing import Any, Iterator, Optional, Union

from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams

from ..chat_template import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from ..pins import PrefixPin
from .native import NativeBackend, Prompt, is_text


class EngineBackend(NativeBackend):
    def __init__(
        self, engine: Any, chat_template: Optional[Union[ChatTemplate, str]] = None, program_hints: bool = True
    ) -> None:
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        tokenizer = getattr(engine, "tokenizer", None)
        if chat_template is None and tokenizer is not None:
            chat_template = chat_template_from_tokenizer(tokenizer, self._model_name_of(engine))
        super().__init__(chat_template)
        self.engine = engine
        self.program_hints = program_hints
        self._shutting_down = False

    @staticmethod
    def _model_name_of(engine: Any) -> str:
        for owner in (engine, getattr(engine, "server_args", None)):
            for attr in ("model_path", "served_model_name"):
                value = getattr(owner, attr, None)
                if value:
                    return str(value)
        return "plait-default-model"

    def get_model_name(self) -> str:
        return self._model_name_of(self.engine)

    # ---- transport: the request's objects, handed to the Engine as they are ----
    def _send(self, prompt: Prompt, sampling: SamplingParams, options: RequestOptions):
        key = "prompt" if is_text(prompt) else "input_ids"
        return self.engine.generate(**{key: prompt}, sampling_params=sampling, options=options)

    def _send_stream(
        self, prompt: Union[str, list[int]], sampling: SamplingParams, options: RequestOptions
    ) -> Iterator[tuple[str, dict]]:
        from plait.runtime.engine.streams import CumulativeOutput

        key = "prompt" if is_text(prompt) else "input_ids"
        output = CumulativeOutput()  # (the Engine streams deltas: meta_info's logprobs so far are kept here)
        for delta in self.engine.stream_deltas(**{key: prompt}, sampling_params=sampling, options=options):
            output.add(delta)
            yield delta["text"], output.meta()

    # ---- what the Engine knows directly ----
    def prefix_cache_enabled(self) -> bool:
        return not getattr(getattr(self.engine, "server_args", None), "disable_radix_cache", False)

    def kv_pool_tokens(self) -> Optional[int]:
        return getattr(getattr(self.engine, "info", None), "max_total_tokens", None)

    def vocab_size(self) -> Optional[int]:
        return getattr(getattr(self.engine, "info", None), "vocab_size", None)

    def tokenize(self, text: str) -> Optional[list[int]]:
        manager = getattr(self.engine, "tokenizer_manager", None)
        return manager.tokenize(text) if manager is not None else None  # exactly what generate() sends

    def pin_prefix(self, prefix: Union[str, list[int]]) -> Optional[PrefixPin]:
        if not prefix or not hasattr(self.engine, "pin_prefix"):
            return None
        pinned = self.engine.pin_prefix(prefix)
        if not isinstance(pinned, dict) or pinned.get("pin_id") is None:
            return None
        return PrefixPin(pinned["pin_id"], int(pinned.get("pinned_tokens") or 0))

    def unpin_prefix(self, pin: PrefixPin) -> None:
        if pin is None or not hasattr(self.engine, "unpin_prefix"):
            return
        try:
            self.engine.unpin_prefix(pin.pin_id)
        except RuntimeError:
            # NOTE: a program that just ended gives its pins back on a pin thread; when the user shuts
            # the engine down right after reading the last result, that call can be in flight as the
            # engine stops. Its pins went with the engine: nothing is lost, nothing to report.
            if not self._shutting_down:
                raise

    # ---- management ----
    def flush_cache(self) -> Any:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        self._shutting_down = True
        self.pin_service().shutdown()  # pin calls already queued finish against the live engine
        self.engine.shutdown()


class Runtime:
    """An in-process Engine for DSL programs: `plait.set_default_backend(plait.Runtime())`.

    Keyword arguments are ServerArgs fields (model_path=None picks the embedded default model).
    SGLang's launch-only arguments (`launch_timeout`) are accepted and ignored: nothing is launched.
    SGLang's parallelism sizes (`tp_size`, `pp_size`, `dp_size`) are ServerArgs fields too; a size the
    model cannot be split by is a ValueError naming the numbers.
    """

    def __init__(
        self,
        model_path: Optional[str] = None,
        chat_template: Optional[Union[ChatTemplate, str]] = None,
        launch_timeout: Optional[float] = None,
        program_hints: bool = True,
        **server_args: Any,
    ) -> None:
        from plait.runtime import Engine

        self.engine = Engine(model_path=model_path, **server_args)
        self.endpoint = EngineBackend(self.engine, chat_template, program_hints=program_hints)
        # Shut the engine down at exit even if the user forgets; weakref so this keeps nothing alive.
        self._atexit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._atexit)

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            self.endpoint.shutdown()  # the pins first, then the engine
            atexit.unregister(self._atexit)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _live_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("this Runtime has been shut down")
        return self.engine

    def get_tokenizer(self) -> Any:
        return self._live_engine().tokenizer

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def flush_cache(self) -> Any:
        return self._live_engine().flush_cache()

    def get_server_info(self) -> dict:
        return self._live_engine().get_server_info()

    def generate(self, prompt: Any = None, sampling_params: Optional[dict] = None, **kwargs: Any) -> Any:
        """Plain generation, as Engine.generate (SGLang's Runtime returns a JSON string; this returns
        the dict)."""
        return self._live_engine().generate(prompt=prompt, sampling_params=sampling_params, **kwargs)

    async def async_generate(self, prompt: Any = None, sampling_params: Optional[dict] = None, **kwargs: Any):
        return await self._live_engine().async_generate(prompt=prompt, sampling_params=sampling_params, **kwargs)


def _shutdown_if_alive(runtime_ref: "weakref.ref[Runtime]") -> None:
    runtime = runtime_ref()
    if runtime is not None:
        runtime.shutdown()
