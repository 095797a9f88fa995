"""SGLang Engine methods plait does not have, each a clear NotImplementedError naming it and why.

Code written for SGLang's offline Engine calls them (RL loops update weights, notebooks start the
profiler); without these an AttributeError left users guessing whether they misspelled the name.
"""

from __future__ import annotations

from typing import Any, Callable

_WEIGHTS = "the weights are loaded once, at start-up; start a new Engine with the new model_path"
_NO_EMBEDDINGS = "plait serves generative (causal LM) models only; it computes no embeddings or scores"
_MEMORY = "plait holds its KV cache for the Engine's lifetime; shut the Engine down to free it"
_PROFILE = "profile the scheduler process with PLAIT_SCHEDULER_PROFILE=path (cProfile) or PLAIT_SCHEDULER_TRACE=path"


def _unsupported(name: str, why: str) -> Callable[..., Any]:
    def method(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"Engine.{name}() (an SGLang Engine method) is not supported by plait: {why}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not supported (SGLang has it): {why}."
    return method


class SGLangEngineExtras:
    """Mixed into Engine: the SGLang Engine API beyond generation, as NotImplementedError."""

    encode = _unsupported("encode", _NO_EMBEDDINGS)
    async_encode = _unsupported("async_encode", _NO_EMBEDDINGS)
    rerank = _unsupported("rerank", _NO_EMBEDDINGS)
    score = _unsupported("score", _NO_EMBEDDINGS)
    async_score = _unsupported("async_score", _NO_EMBEDDINGS)
    update_weights_from_disk = _unsupported("update_weights_from_disk", _WEIGHTS)
    update_weights_from_tensor = _unsupported("update_weights_from_tensor", _WEIGHTS)
    update_weights_from_distributed = _unsupported("update_weights_from_distributed", _WEIGHTS)
    init_weights_update_group = _unsupported("init_weights_update_group", _WEIGHTS)
    get_weights_by_name = _unsupported("get_weights_by_name", "the weights live in the scheduler process")
    release_memory_occupation = _unsupported("release_memory_occupation", _MEMORY)
    resume_memory_occupation = _unsupported("resume_memory_occupation", _MEMORY)
    start_profile = _unsupported("start_profile", _PROFILE)
    stop_profile = _unsupported("stop_profile", _PROFILE)
