"""ServerContext: what every route needs, built once per app (no module-level state).

Facts about the model (context length, vocabulary size, the name clients must send) are resolved
here once, tolerating the few attribute spellings an Engine / HF config may use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from starlette.requests import Request

from ..server_args import ServerArgs
from .engine_client import AdmissionControl, GenerationGroup
from .metrics import ServerMetrics
from .openai.token_bytes import TokenBytes
from .responses.store import ResponseStore

# SGLang's OpenAI examples send model="default"; accept it as an alias of the served model.
DEFAULT_MODEL_ALIAS = "default"


def _first_int(objs: list[Any], names: tuple[str, ...]) -> Optional[int]:
    for obj in objs:
        if obj is None:
            continue
        for name in names:
            v = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


@dataclass
class ServerContext:
    engine: Any
    server_args: ServerArgs
    model_name: str
    accepted_model_names: frozenset[str]
    context_len: Optional[int]
    vocab_size: Optional[int]
    metrics: ServerMetrics
    admission: AdmissionControl
    responses: ResponseStore  # stored Responses (previous_response_id)
    token_bytes: Optional[TokenBytes] = None  # None without a tokenizer
    started_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    logged_once: set[str] = field(default_factory=set)  # what protocol.compat.review has logged

    @classmethod
    def build(cls, engine: Any, server_args: ServerArgs) -> "ServerContext":
        engine_model_path = getattr(engine, "model_path", None)
        name = (
            server_args.served_model_name
            or server_args.model_path
            or (os.path.basename(str(engine_model_path).rstrip("/")) if engine_model_path else None)
            or DEFAULT_MODEL_ALIAS
        )
        accepted = {name, DEFAULT_MODEL_ALIAS}
        for alias in (server_args.model_path, engine_model_path):
            if alias:
                # The path as given and the folder's own name ("Llama-3.1-8B-Instruct" for a path ending so).
                accepted.update({str(alias), os.path.basename(str(alias).rstrip("/"))})
        model_config = getattr(engine, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        tokenizer = getattr(engine, "tokenizer", None)
        context_len = server_args.context_length or _first_int(
            [model_config, hf_config], ("context_len", "context_length", "max_position_embeddings", "max_seq_len")
        )
        vocab_size = _first_int([model_config, hf_config], ("vocab_size",))
        if vocab_size is None and tokenizer is not None:
            vocab_size = len(tokenizer)
        metrics = ServerMetrics(name)
        limit = None
        if server_args.max_queued_requests is not None:
            info = getattr(engine, "info", None)  # the scheduler's resolved value (None: chosen by device)
            running = getattr(info, "max_running_requests", None) or server_args.max_running_requests or 256
            limit = running + server_args.max_queued_requests
        return cls(
            engine=engine,
            server_args=server_args,
            model_name=name,
            accepted_model_names=frozenset(accepted),
            context_len=context_len,
            vocab_size=vocab_size,
            metrics=metrics,
            admission=AdmissionControl(limit, metrics),
            responses=ResponseStore(engine),
            token_bytes=TokenBytes(tokenizer) if tokenizer is not None else None,
        )

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def new_group(self, request: Optional[Request], log_metrics: bool = True) -> GenerationGroup:
        return GenerationGroup(
            engine=self.engine, admission=self.admission, metrics=self.metrics, request=request, log_metrics=log_metrics
        )


def get_context(request: Request) -> ServerContext:
    return request.app.state.plait
