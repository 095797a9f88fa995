"""The colocated backend: programs call the in-process Engine directly (no HTTP).

`plait.Runtime(model_path=None, **server_args)` starts an Engine in this process (the embedded
default model when model_path is None) and exposes it as `.endpoint`, an EngineBackend, the way
SGLang's Runtime exposes a RuntimeEndpoint.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import weakref
from typing import Any, AsyncIterator, Iterator, Optional, Union

from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams

from ..chat_template import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from ..pins import PrefixPin
from .native import NativeBackend, Prompt, is_text
from .runtime_http import LocalHTTPServer


class EngineBackend(NativeBackend):
    def __init__(
        self,
        engine: Any,
        chat_template: Optional[Union[ChatTemplate, str]] = None,
        program_hints: bool = True,
        model_name: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> None:
        """`model_name`: what `get_model_name()` reports (the Runtime passes the model path as the user gave
        it); by default the engine's served_model_name, else its model folder's name. `lora`: the LoRA
        adapter of the requests whose gen and program name none."""
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.model_name = model_name or served_model_name(engine)
        tokenizer = getattr(engine, "tokenizer", None)
        if chat_template is None and tokenizer is not None:
            chat_template = chat_template_from_tokenizer(tokenizer, self.model_name)
        super().__init__(chat_template)
        self.engine = engine
        self.program_hints = program_hints
        self.lora = lora
        self._shutting_down = False

    def get_model_name(self) -> str:
        return self.model_name

    # ---- transport: the request's objects, handed to the Engine as they are ----
    def _send(self, prompt: Prompt, sampling: SamplingParams, options: RequestOptions, image_data: Any = None):
        key = "prompt" if is_text(prompt) else "input_ids"
        return self.engine.generate(**{key: prompt}, sampling_params=sampling, options=options, image_data=image_data)

    def _send_stream(
        self, prompt: Union[str, list[int]], sampling: SamplingParams, options: RequestOptions, image_data: Any = None
    ) -> Iterator[tuple[str, dict]]:
        from plait.runtime.engine.streams import CumulativeOutput

        key = "prompt" if is_text(prompt) else "input_ids"
        output = CumulativeOutput()  # (the Engine streams deltas: meta_info's logprobs so far are kept here)
        stream = self.engine.stream_deltas(
            **{key: prompt}, sampling_params=sampling, options=options, image_data=image_data
        )
        for delta in stream:
            output.add(delta)
            yield delta["text"], output.meta()

    # ---- what the Engine knows directly ----
    def prefix_cache_enabled(self) -> bool:
        return not getattr(getattr(self.engine, "server_args", None), "disable_radix_cache", False)

    def kv_pool_tokens(self) -> Optional[int]:
        return getattr(getattr(self.engine, "info", None), "max_total_tokens", None)

    def kv_free_tokens(self) -> Optional[int]:
        return self.engine.get_stats().get("free_tokens") if hasattr(self.engine, "get_stats") else None

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

    def is_shutting_down(self) -> bool:
        return self._shutting_down

    def shutdown(self) -> None:
        self._shutting_down = True
        self.pin_service().shutdown()  # pin calls already queued finish against the live engine
        self.engine.shutdown()


def served_model_name(engine: Any) -> str:
    """The name plait's server reports for `engine`'s model: served_model_name, else the model folder's name
    (never the folder's path: the embedded default model lives in a cache folder)."""
    served = getattr(getattr(engine, "server_args", None), "served_model_name", None)
    if served:
        return str(served)
    path = getattr(engine, "model_path", None)
    return os.path.basename(str(path).rstrip("/")) if path else "default"


class Runtime:
    """An in-process Engine for DSL programs: `plait.set_default_backend(plait.Runtime())`.

    Keyword arguments are ServerArgs fields (model_path=None picks the embedded default model).
    SGLang's launch-only arguments (`launch_timeout`, `log_level`) are accepted; nothing is launched, but
    reading `url` serves plait's HTTP API over this Engine (runtime_http.py), as SGLang's Runtime serves.
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
        self._http: Optional[LocalHTTPServer] = None
        name = self.engine.server_args.served_model_name or model_path or served_model_name(self.engine)
        self.endpoint = EngineBackend(self.engine, chat_template, program_hints=program_hints, model_name=name)
        # Shut the engine down at exit even if the user forgets; weakref so this keeps nothing alive.
        self._atexit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._atexit)

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            if self._http is not None:
                self._http.stop()  # its requests end before the engine they read from
            self.endpoint.shutdown()  # the pins first, then the engine
            atexit.unregister(self._atexit)

    @property
    def server_args(self) -> Any:
        return self._live_engine().server_args

    @property
    def url(self) -> str:
        """The address of plait's HTTP API (SGLang's native routes and the OpenAI ones) over this Runtime's
        Engine, served from the first read on."""
        engine = self._live_engine()
        if self._http is None:
            self._http = LocalHTTPServer(engine)
        return self._http.url

    @property
    def generate_url(self) -> str:
        return self.url + "/generate"

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

    def generate(self, prompt: Any = None, sampling_params: Optional[dict] = None, **kwargs: Any) -> str:
        """Plain generation, as Engine.generate takes it, returned as SGLang's Runtime returns it: the JSON
        text of the output (`json.loads(runtime.generate(...))["text"]`)."""
        return json.dumps(self._live_engine().generate(prompt=prompt, sampling_params=sampling_params, **kwargs))

    async def async_generate(self, prompt: Any, sampling_params: Optional[dict] = None) -> AsyncIterator[str]:
        """Stream one prompt's output as SGLang's Runtime does: each new piece of text as it comes (a list of
        token ids is taken as the prompt's ids)."""
        key = "prompt" if is_text(prompt) else "input_ids"
        deltas = await self._live_engine().async_stream_deltas(**{key: prompt}, sampling_params=sampling_params)
        async for delta in deltas:
            if delta["text"]:
                yield delta["text"]

    add_request = async_generate

    def encode(self, prompt: Any) -> str:
        """SGLang's embedding call, as its JSON text (plait's Engine says why it computes no embeddings)."""
        return json.dumps(self._live_engine().encode(prompt))

    def start_profile(self) -> None:
        self._live_engine().start_profile()

    def stop_profile(self) -> None:
        self._live_engine().stop_profile()


def _shutdown_if_alive(runtime_ref: "weakref.ref[Runtime]") -> None:
    runtime = runtime_ref()
    if runtime is not None:
        runtime.shutdown()
