"""How `gen(...)` arguments and `run(...)` defaults become one runtime `SamplingParams`.

`SamplingParams` (runtime/sampling_params.py) is the single definition of every sampling field. The DSL
only adds two spellings SGLang's frontend uses (`max_tokens`, `min_tokens`), four request-level
logprob options that are not sampling fields, and `dtype`. Everything else passes through by name, so a
field added to `SamplingParams` is usable from `run(...)` at once.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from plait.runtime.sampling_params import SamplingParams

# The dtype regexes live in plait.ir, where SGLang programs import them from (sglang.lang.ir).
from .ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

# gen()'s spelling -> SamplingParams' field name.
DSL_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# Request-level options sent next to `sampling_params` (SGLang's /generate fields).
LOGPROB_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
SAMPLING_FIELDS = frozenset(SamplingParams.field_names())


@dataclass(frozen=True)
class GenOverrides:
    """What one gen() call sets explicitly; anything absent inherits the run() defaults."""

    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    logprob: Mapping[str, Any] = field(default_factory=dict)  # LOGPROB_OPTIONS -> value
    dtype: Optional[Union[type, str]] = None

    @classmethod
    def from_gen_kwargs(cls, kwargs: Mapping[str, Any], where: str = "gen()") -> "GenOverrides":
        """Split gen()'s keyword arguments; `None` means 'not set'. Unknown names raise."""
        sampling: dict[str, Any] = {}
        logprob: dict[str, Any] = {}
        dtype = None
        for key, value in kwargs.items():
            if value is None:
                continue
            if key == "dtype":
                dtype = value
            elif key in LOGPROB_OPTIONS:
                logprob[key] = value
            else:
                name = DSL_ALIASES.get(key, key)
                if name not in SAMPLING_FIELDS:
                    raise TypeError(f"gen() got an unknown sampling argument {key!r}")
                sampling[name] = value
        if dtype is not None:
            dtype_regex(dtype)  # fail early on an unknown dtype
        check_settings(sampling, where)
        return cls(sampling=sampling, logprob=logprob, dtype=dtype)


@dataclass
class RunDefaults:
    """The sampling defaults of one program run: `run(max_new_tokens=..., temperature=...)`."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprob: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "RunDefaults":
        sampling: dict[str, Any] = {}
        logprob: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in LOGPROB_OPTIONS:
                if value is not None:
                    logprob[key] = value
                continue
            name = DSL_ALIASES.get(key, key)
            if name not in SAMPLING_FIELDS:
                raise TypeError(f"unknown sampling argument {key!r}")
            # SGLang's run() spells "no stop" as [] or (); SamplingParams uses None.
            if name in ("stop", "stop_token_ids", "stop_regex") and not value:
                value = None
            sampling[name] = value
        check_settings(sampling, "run()")
        return cls(sampling=SamplingParams.from_dict(sampling), logprob=logprob)

    @staticmethod
    def is_sampling_name(key: str) -> bool:
        return key in LOGPROB_OPTIONS or DSL_ALIASES.get(key, key) in SAMPLING_FIELDS


@dataclass
class ResolvedGen:
    """A gen() ready to send: full sampling params, logprob options, and the dtype it came from."""

    sampling: SamplingParams
    logprob: dict[str, Any]
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

    def request_sampling_dict(self) -> dict[str, Any]:
        """The `sampling_params` dict for a native /generate request.

        Only fields that differ from SamplingParams' defaults are sent (plus max_new_tokens and
        temperature), so SGLang servers, which lack some of plait's extra fields, accept it too.
        """
        defaults = SamplingParams()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(SamplingParams):
            value = getattr(self.sampling, f.name)
            if f.name in ("max_new_tokens", "temperature") or value != getattr(defaults, f.name):
                out[f.name] = value
        return out


def resolve_gen(defaults: RunDefaults, overrides: GenOverrides, chat_stop: tuple[str, ...] = ()) -> ResolvedGen:
    """run() defaults, then gen() overrides, then the dtype's regex and stops, then the chat stops."""
    merged = defaults.sampling.to_dict()
    merged.update(copy.deepcopy(dict(overrides.sampling)))
    stops = _as_list(merged.get("stop"))
    if overrides.dtype is not None:
        regex, extra_stops = dtype_regex(overrides.dtype)
        merged["regex"] = regex
        merged["json_schema"] = None
        stops += [s for s in extra_stops if s not in stops]
    stops += [s for s in chat_stop if s not in stops]
    merged["stop"] = stops or None
    sampling = SamplingParams.from_dict(merged)
    sampling.verify()
    logprob = {**defaults.logprob, **overrides.logprob}
    return ResolvedGen(sampling=sampling, logprob=logprob, dtype=overrides.dtype)


def check_settings(sampling: Mapping[str, Any], where: str) -> None:
    """Raise ValueError, where the program wrote them, for settings no merge can make valid
    (`temperature=-1`, `top_p=2`, `max_tokens=-1`, ...).

    NOTE: without this, a bad value only failed on the program's worker thread, and run() returned a
    state whose error() held it. `max_new_tokens` stays unset (no limit) unless given, so a gen's
    `min_tokens` is not judged against a default limit that run() may raise; resolve_gen checks the
    merged settings again."""
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
