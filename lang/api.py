"""The public functions of the language: function, gen, select, roles, backends."""

from __future__ import annotations

import re
from typing import Any, Callable, List, Optional, Union

from plait.grammars.regexes import REGEXES as NAMED_REGEXES

from .choices import ChoicesSamplingMethod, CustomChoicesMethod, token_length_normalized
from .function import SglFunction
from .gen_params import GenOverrides
from .global_config import global_config
from .ir import SglExpr, SglExprList, SglGen, SglImage, SglRoleBegin, SglRoleEnd, SglSelect, SglVideo, as_expr, flatten
from .reasoning import reasoning_markers


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    """Decorate a program: `@function` or `@function(...)`; its first parameter is the state `s`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)


def set_default_backend(backend: Any) -> None:
    global_config.default_backend = backend


def _backend(backend: Any) -> Any:
    backend = backend or global_config.default_backend
    return backend.endpoint if hasattr(backend, "endpoint") else backend


def flush_cache(backend: Any = None) -> Any:
    """Drop the runtime's prefix cache; False when there is no backend."""
    backend = _backend(backend)
    return False if backend is None else backend.flush_cache()


def get_server_info(backend: Any = None) -> Optional[dict]:
    backend = _backend(backend)
    return None if backend is None else backend.get_server_info()


def gen(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    min_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, List[str]]] = None,
    stop_token_ids: Optional[List[int]] = None,
    stop_regex: Optional[Union[str, List[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
    dtype: Optional[Union[type, str]] = None,
    choices: Optional[List[str]] = None,
    choices_method: Optional[ChoicesSamplingMethod] = None,
    regex: Optional[str] = None,
    json_schema: Optional[Union[str, dict, type]] = None,
    ebnf: Optional[str] = None,
    lora: Optional[str] = None,
) -> SglExpr:
    """Generate into variable `name`. Every argument left None inherits the run() defaults
    (max_new_tokens=128, temperature=1.0, ...); the names map onto plait.runtime.SamplingParams.
    With `choices`, this is select(). `regex` may also name a built-in pattern of
    plait.grammars.regexes ("integer", "float", "boolean", "iso_date", "email", "ipv4", ...).
    `json_schema` takes a dict, a JSON string or a Pydantic model class; with a class,
    `state.parsed(name)` returns the output as an instance of it. `lora` names the runtime's LoRA adapter
    this gen runs with (default: the program's, `run(lora=...)`, else the backend's, else the base model)."""
    if choices:
        if lora is not None:
            # NOTE: a select scores the choices with the program's adapter; a gen's own would be dropped silently.
            raise ValueError(f"gen({name!r}): choices are scored with the program's LoRA adapter; pass run(lora=...)")
        return select(
            name, choices, 0.0 if temperature is None else temperature, choices_method or token_length_normalized
        )
    output_model = _schema_model(name, json_schema)
    if output_model is not None:
        json_schema = output_model.model_json_schema()
    if regex is not None:
        regex = NAMED_REGEXES.get(regex, regex)
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen({name!r}): regex {regex!r} is not valid: {e}") from None
    # NOTE: the parameters themselves are the settings (SGLang's signature, kept for positional
    # callers); GenOverrides maps each name onto SamplingParams, so nothing is listed twice.
    settings = dict(locals())
    for key in ("name", "choices", "choices_method", "output_model"):
        settings.pop(key)
    expr = SglGen(name, GenOverrides.from_gen_kwargs(settings))
    expr.output_model = output_model
    return expr


def _schema_model(name: Optional[str], json_schema: Any) -> Optional[type]:
    """The Pydantic model class `json_schema` is, None for a dict or a JSON string; TypeError otherwise.

    NOTE: checked here, where the gen is written: another value (json_schema=5) found on the program's
    worker thread would fail far from its cause."""
    if isinstance(json_schema, type) and hasattr(json_schema, "model_json_schema"):
        return json_schema
    if json_schema is not None and not isinstance(json_schema, (dict, str)):
        raise TypeError(
            f"gen({name!r}): json_schema must be a dict, a JSON string or a Pydantic model class, got {json_schema!r}"
        )
    return None


def gen_int(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs: Any) -> SglExpr:
    """gen() of an integer: constrained by REGEX_INT, stopped at a space or newline."""
    return _typed_gen(name, max_tokens, int, kwargs)


def gen_string(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs: Any) -> SglExpr:
    """gen() of a double-quoted string: constrained by REGEX_STR."""
    return _typed_gen(name, max_tokens, str, kwargs)


def _typed_gen(name: Optional[str], max_tokens: Optional[int], dtype: type, kwargs: dict) -> SglExpr:
    clash = sorted(set(kwargs) & {"dtype", "regex", "json_schema", "ebnf", "choices", "choices_method"})
    if clash:
        raise TypeError(f"gen_{dtype.__name__}() fixes the output format; it does not take {clash}")
    return gen(name, max_tokens, dtype=dtype, **kwargs)


def select(
    name: Optional[str] = None,
    choices: Optional[List[str]] = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> SglExpr:
    """Append the choice the model finds most likely (scored by prompt logprobs) into `name`."""
    if isinstance(choices, str):  # its characters would be the choices
        raise TypeError(f"select({name!r}): choices must be a list of str, got the str {choices!r}")
    if not choices:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices")
    if not all(isinstance(c, str) for c in choices):
        raise TypeError(f"select({name!r}): every choice must be a str")
    if "" in choices:
        # NOTE: an empty choice has no tokens to score; it was scored by whatever the prompt's last
        # token position gave (-inf after a one-token prompt, the prompt's own last token otherwise).
        raise ValueError(
            f"select({name!r}): choice {choices.index('')} is the empty string, which has no "
            f"tokens to score; give every choice some text"
        )
    if not isinstance(choices_method, ChoicesSamplingMethod):
        if not callable(choices_method):
            raise TypeError(
                f"select({name!r}): choices_method must be a choice method (a callable taking choices= and the "
                f"logprobs as keywords), got {choices_method!r}"
            )
        choices_method = CustomChoicesMethod(choices_method)
    return SglSelect(name, list(choices), temperature, choices_method)


def separate_reasoning(expr: Any = None, model_type: Optional[str] = None) -> SglExpr:
    """Split a reasoning model's output: `separate_reasoning(gen("answer"), model_type="deepseek-r1")` leaves
    the answer in "answer" and the thinking in "answer_reasoning_content" (model types: reasoning.py)."""
    markers = reasoning_markers(model_type)
    expr = as_expr(expr)
    gens = [node for node in flatten(expr) if isinstance(node, SglGen)]
    if not gens or gens[-1].name is None:
        raise ValueError("separate_reasoning() wraps a named gen, e.g. separate_reasoning(gen('answer'), ...)")
    gens[-1].reasoning = markers
    return expr


def image(expr: Any) -> SglExpr:
    """An image for a vision model (a path, bytes, base64, a data: URL or a PIL image): the chat
    template's image token goes into the text, the image with every request that text is part of."""
    return SglImage(expr)


def video(path: str, num_frames: int) -> SglExpr:
    """A video as `num_frames` frames sampled evenly from the file, each an image (see `image`)."""
    if not isinstance(num_frames, int) or num_frames <= 0:
        raise ValueError(f"video() takes a positive num_frames, got {num_frames!r}")
    return SglVideo(path, num_frames)


def _role_common(role: str, expr: Any = None) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglExprList([SglRoleBegin(role), as_expr(expr), SglRoleEnd(role)])


def system(expr: Any = None) -> SglExprList:
    return _role_common("system", expr)


def user(expr: Any = None) -> SglExprList:
    return _role_common("user", expr)


def assistant(expr: Any = None) -> SglExprList:
    return _role_common("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")
