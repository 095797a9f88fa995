"""plait: SGLang-compatible frontend language for structured LLM programs.

import plait as sgl

@sgl.function
def qa(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))

sgl.set_default_backend(sgl.Runtime())      # in-process engine, embedded default model
print(qa.run(question="What is 2 + 2?")["answer"])
"""

from .api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from .backend.anthropic_backend import Anthropic
from .backend.base import BaseBackend
from .backend.engine_backend import EngineBackend, Runtime
from .backend.litellm_backend import LiteLLM
from .backend.openai_backend import OpenAI
from .backend.runtime_endpoint import RuntimeEndpoint
from .backend.vertexai_backend import VertexAI
from .chat_template import (
    ChatTemplate,
    chat_template_from_tokenizer,
    get_chat_template,
    get_chat_template_by_model_path,
)
from .choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from .function import SglFunction
from .global_config import global_config
from .state import ProgramState, ProgramStateGroup
from .version import __version__


def __getattr__(name: str):
    # Lazy: `import plait` must not import torch and the model code.
    if name in ("Engine", "SamplingParams", "ServerArgs"):
        import plait.runtime

        return getattr(plait.runtime, name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


__all__ = [
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "separate_reasoning",
    "image",
    "video",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "set_default_backend",
    "flush_cache",
    "get_server_info",
    "global_config",
    "Runtime",
    "RuntimeEndpoint",
    "OpenAI",
    "Anthropic",
    "LiteLLM",
    "VertexAI",
    "Engine",
    "BaseBackend",
    "EngineBackend",
    "ChatTemplate",
    "get_chat_template",
    "get_chat_template_by_model_path",
    "chat_template_from_tokenizer",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "token_length_normalized",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
    "SglFunction",
    "ProgramState",
    "ProgramStateGroup",
    "SamplingParams",
    "ServerArgs",
    "__version__",
]
