"""How `gen(...)` arguments and `run(...)` defaults become one runtime `SamplingParams` and one
`RequestOptions` per gen.

`SamplingParams` (runtime/sampling_params.py) is the single definition of every sampling field. The DSL
only adds two spellings SGLang's frontend uses (`max_tokens`, `min_tokens`), request-level options that
are not sampling fields (four logprob options and `lora`, the LoRA adapter: they become the gen's
`RequestOptions`), and `dtype`.
Everything else passes through by name, so a field added to `SamplingParams` is usable from `run(...)`
at once. `resolve_gen` builds a gen's SamplingParams once and verifies it once; the backends hand that
object on (the Engine does not build or verify it again).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams

from .global_config import global_config

# The dtype regexes live in plait.ir, where SGLang programs import them from (sglang.lang.ir).
from .ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SglExpr, SglGen, flatten

logger = logging.getLogger(__name__)

# gen()'s spelling -> SamplingParams' field name.
DSL_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# Request-level options sent next to `sampling_params` (SGLang's /generate fields).
LOGPROB_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
# The DSL's spelling -> RequestOptions' field, for request options that are not logprob ones. SGLang's
# frontend has no adapter argument; `lora` names one of the runtime's loaded LoRA adapters (its request
# field, `lora_path`).
OPTION_ALIASES = {"lora": "lora_path"}
REQUEST_OPTIONS = frozenset(LOGPROB_OPTIONS) | frozenset(OPTION_ALIASES)
SAMPLING_FIELDS = frozenset(SamplingParams.field_names())


@dataclass(frozen=True)
class GenOverrides:
    """What one gen() call sets explicitly; anything absent inherits the run() defaults."""

    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    options: Mapping[str, Any] = field(default_factory=dict)  # RequestOptions field -> value
    dtype: Optional[Union[type, str]] = None

    @classmethod
    def from_gen_kwargs(cls, kwargs: Mapping[str, Any]) -> "GenOverrides":
        """Split gen()'s keyword arguments; `None` means 'not set'. Unknown names raise; values are
        checked once, merged with the run's defaults, when the gen is submitted (`resolve_gens`)."""
        sampling: dict[str, Any] = {}
        options: dict[str, Any] = {}
        dtype = None
        for key, value in kwargs.items():
            if value is None:
                continue
            if key == "dtype":
                dtype = value
            elif key in REQUEST_OPTIONS:
                options[OPTION_ALIASES.get(key, key)] = value
            else:
                name = DSL_ALIASES.get(key, key)
                if name not in SAMPLING_FIELDS:
                    raise TypeError(f"gen() got an unknown sampling argument {key!r}")
                sampling[name] = value
        if dtype is not None:
            dtype_regex(dtype)  # fail early on an unknown dtype
        return cls(sampling=sampling, options=options, dtype=dtype)


@dataclass
class RunDefaults:
    """The sampling defaults of one program run: `run(max_new_tokens=..., temperature=...)`."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    options: dict[str, Any] = field(default_factory=dict)  # RequestOptions field -> value
    # `sampling` as the fields each gen's parameters start from (read once per run, not once per gen).
    fields: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.fields = self.sampling.to_dict()

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "RunDefaults":
        sampling: dict[str, Any] = {}
        options: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in REQUEST_OPTIONS:
                if value is not None:
                    options[OPTION_ALIASES.get(key, key)] = value
                continue
            name = DSL_ALIASES.get(key, key)
            if name not in SAMPLING_FIELDS:
                raise TypeError(f"unknown sampling argument {key!r}")
            # SGLang's run() spells "no stop" as [] or (); SamplingParams uses None.
            if name in ("stop", "stop_token_ids", "stop_regex") and not value:
                value = None
            sampling[name] = value
        check_settings(sampling, "run()")
        RequestOptions.of(**options)  # a bad value (lora=5) is an error where run() is called
        return cls(sampling=SamplingParams.from_dict(sampling), options=options)

    @property
    def lora_path(self) -> Optional[str]:
        """The program's LoRA adapter (`run(lora=...)`): its requests that are not a gen's (prefills,
        select) run with it too, so they share the gens' cached prefixes."""
        return self.options.get("lora_path")

    @staticmethod
    def is_sampling_name(key: str) -> bool:
        return key in REQUEST_OPTIONS or DSL_ALIASES.get(key, key) in SAMPLING_FIELDS


@dataclass
class ResolvedGen:
    """A gen() ready to send: its sampling parameters (verified), its request options (logprobs) and the
    dtype it came from."""

    sampling: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    dtype: Optional[Union[type, str]] = None

    def constraint(self) -> Optional[str]:
        """The kind of grammar the output must match ('json_schema', 'regex', 'ebnf'), or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            if getattr(self.sampling, kind, None):
                return kind
        return None

    def cut_short(self, text: Any, meta: Any) -> bool:
        """True when a constrained output stopped at max_new_tokens short of a match: JSON that does
        not parse, text the regex does not fullmatch. (EBNF outputs are not checked.)

        NOTE: finish_reason "length" alone does not say it: an output that completes the grammar on
        its last allowed token also ends with "length"."""
        kind = self.constraint()
        if kind not in ("json_schema", "regex"):
            return False
        texts = text if isinstance(text, list) else [text]
        metas = meta if isinstance(meta, list) else [meta]
        for one_text, info in zip(texts, metas):
            reason = info.get("finish_reason") if isinstance(info, dict) else None
            if not (isinstance(reason, dict) and reason.get("type") == "length"):
                continue
            if kind == "regex" and re.fullmatch(self.sampling.regex, one_text) is None:
                return True
            if kind == "json_schema":
                try:
                    json.loads(one_text)
                except ValueError:
                    return True
        return False

    def warn_if_cut_short(self, name: Optional[str], text: Any, meta: Any) -> None:
        # NOTE: a truncated constrained output is a normal result (finish_reason "length"), not an
        # error; but code that json.loads it fails far from the cause, so say where it came from.
        if self.cut_short(text, meta):
            logger.warning(
                "gen(%r) stopped at max_tokens=%s before its %s was complete: the value is a "
                "prefix of a match, not a match (raise max_tokens)",
                name,
                self.sampling.max_new_tokens,
                self.constraint(),
            )


def resolve_gen(
    defaults: RunDefaults,
    overrides: GenOverrides,
    chat_stop: tuple[str, ...] = (),
    vocab_size: Optional[int] = None,
) -> ResolvedGen:
    """run() defaults, then gen() overrides, then the dtype's regex and stops, then the chat stops; the
    SamplingParams verified (against `vocab_size`, the runtime's vocabulary when known here)."""
    merged = dict(defaults.fields)
    merged.update(copy.deepcopy(dict(overrides.sampling)))
    stops = _as_list(merged.get("stop"))
    if overrides.dtype is not None:
        regex, extra_stops = dtype_regex(overrides.dtype)
        merged["regex"] = regex
        merged["json_schema"] = None
        stops += [s for s in extra_stops if s not in stops]
    stops += [s for s in chat_stop if s not in stops]
    merged["stop"] = stops or None
    if not global_config.skip_special_tokens_in_output:
        merged["skip_special_tokens"] = False
    if not global_config.spaces_between_special_tokens_in_out:
        merged["spaces_between_special_tokens"] = False
    sampling = SamplingParams.from_dict(merged)
    sampling.verify(vocab_size)
    options = RequestOptions.of(**{**defaults.options, **overrides.options})
    return ResolvedGen(sampling=sampling, options=options, dtype=overrides.dtype)


def resolve_gens(
    expr: SglExpr, defaults: RunDefaults, chat_stop: tuple[str, ...] = (), vocab_size: Optional[int] = None
) -> dict[int, ResolvedGen]:
    """Every gen of `expr`, resolved (`resolve_gen`), by the node's id. A bad value is a ValueError that
    names the gen: the interpreter resolves an expression when the program submits it, so the error is
    raised where the program writes the gen, and the worker sends what was checked."""
    resolved: dict[int, ResolvedGen] = {}
    for node in flatten(expr):
        if isinstance(node, SglGen) and id(node) not in resolved:
            try:
                resolved[id(node)] = resolve_gen(defaults, node.overrides, chat_stop, vocab_size)
            except ValueError as e:
                raise ValueError(f"gen({node.name!r}): {e}") from None
    return resolved


def check_settings(sampling: Mapping[str, Any], where: str) -> None:
    """Raise ValueError, where the program wrote them, for run() settings no gen can make valid
    (`temperature=-1`, `top_p=2`, `max_tokens=-1`, ...).

    NOTE: without this, a bad value only failed on the program's worker thread, and run() returned a
    state whose error() held it. `max_new_tokens` stays unset (no limit) unless given, so run()'s
    `min_tokens` is not judged against a default limit that a gen may raise; resolve_gen checks each
    gen's merged settings."""
    try:
        SamplingParams.from_dict({"max_new_tokens": None, **sampling}).verify()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def dtype_regex(dtype: Union[type, str]) -> tuple[str, tuple[str, ...]]:
    """The regex and the extra stop strings a `dtype` means (as SGLang's frontend maps them)."""
    if dtype in (int, "int"):
        return REGEX_INT, (" ", "\n")
    if dtype in (float, "float"):
        return REGEX_FLOAT, (" ", "\n")
    if dtype in (str, "str", "string"):
        return REGEX_STR, ()
    if dtype in (bool, "bool"):
        return REGEX_BOOL, ()
    raise ValueError(f"invalid dtype {dtype!r}: use int, float, str or bool")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)
