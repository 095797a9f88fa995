"""SamplingParams: defined once, shared by the DSL (`plait.gen`), the Engine and the HTTP server.

Field names follow SGLang's `sampling_params` dict so that SGLang clients work unchanged.
`SamplingParams.from_dict` rejects unknown keys and `verify()` rejects out-of-range values with a
`ValueError` that names the offending field. A SamplingParams is immutable (frozen): a sample of an
n > 1 request is a new object (`for_sample`), and one that was verified is not verified again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

_GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")
_JSON_STYLE_KINDS = {"natural": "json_natural", "compact": "json", "indent": "json_indent"}  # grammar kinds
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGIT_BIAS = 1e38  # below float32's largest value (3.4e38)
_VERIFIED = "_verified_for_vocab"  # instance attribute set by a successful verify()
_UNVERIFIED = object()


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    # Constrained decoding (mutually exclusive); see runtime/constrained/.
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    # Free whitespace inside JSON output (small models loop on spaces; json_style is the bounded choice).
    json_whitespace: bool = False
    # Layout of a json_schema output: "natural" (", " and ": ", as models write JSON), "compact" ("," and
    # ":") or "indent" (two spaces a level; xgrammar only). None: natural (free whitespace with json_whitespace).
    json_style: Optional[str] = None
    # Near max_new_tokens, or in a loop the grammar would let run to it, a constrained output is steered to
    # its shortest valid completion, so a cut output still parses (runtime/constrained/closing.py).
    close_within_budget: bool = True
    # A json_schema with keywords the grammar backend does not enforce exactly is refused (ValueError naming
    # the keyword and its JSON path) instead of being reported in meta_info.grammar_warnings.
    strict: bool = False
    custom_params: Optional[dict[str, Any]] = None
    # Tokens between two chunks of this request's stream (SGLang's per-request field); None: the server's.
    stream_interval: Optional[int] = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "SamplingParams":
        """Build from a user dict; unknown keys raise ValueError naming them."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d  # (immutable: shared, with its verification)
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        known = set(cls.field_names())
        unknown = sorted(k for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        clean = {k: v for k, v in d.items()}
        if isinstance(clean.get("json_schema"), dict):
            clean["json_schema"] = json.dumps(clean["json_schema"])
        if clean.get("logit_bias"):
            clean["logit_bias"] = _parse_logit_bias(clean["logit_bias"])
        sp = cls(**clean)
        return sp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def for_sample(self, k: int) -> "SamplingParams":
        """Sample k of an n > 1 request: n = 1 and seed + k (verify's seed range covers all n)."""
        sample = dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + k)
        if _VERIFIED in self.__dict__:
            object.__setattr__(sample, _VERIFIED, self.__dict__[_VERIFIED])
        return sample

    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_regexes(self) -> list[str]:
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError naming the first invalid field. Once it has passed for a vocabulary size, it
        returns at once for that size (the object cannot change)."""
        if self.__dict__.get(_VERIFIED, _UNVERIFIED) == vocab_size:
            return
        self._check(vocab_size)
        # NOTE: the one attribute written after construction: a memo of this check's success, not a field
        # (from_dict, to_dict, equality and replace never see it).
        object.__setattr__(self, _VERIFIED, vocab_size)

    def _check(self, vocab_size: Optional[int]) -> None:

        def check_type(name: str, types: tuple, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) and bool not in types:
                raise ValueError(f"{name} must be {types[0].__name__}, got bool")
            if not isinstance(v, types):
                raise ValueError(f"{name} must be {types[0].__name__}, got {type(v).__name__}")

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval"):
            check_type(name, (int,), allow_none=(name in ("max_new_tokens", "stream_interval")))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            check_type(name, (float, int))
            # NOTE: a NaN passes every range comparison below and would poison the whole batch's softmax.
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "no_stop_trim",
            "json_whitespace",
            "close_within_budget",
            "strict",
        ):
            check_type(name, (bool,))
        if self.json_style is not None and self.json_style not in _JSON_STYLE_KINDS:
            raise ValueError(f"json_style must be one of {list(_JSON_STYLE_KINDS)}, got {self.json_style!r}")
        if self.json_style is not None and self.json_whitespace:
            raise ValueError(
                f"json_whitespace (free whitespace) and json_style={self.json_style!r} cannot work "
                "together; set one of them"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int, got {type(self.seed).__name__}")
        # n samples take seeds seed .. seed + n - 1, each a torch.Generator seed: a 64-bit value.
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            raise ValueError(
                f"seed must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] (a 64-bit seed for each of "
                f"the n={self.n} samples), got {self.seed}"
            )
        for name in ("stop", "stop_regex"):
            v = getattr(self, name)
            if v is None:
                continue
            items = [v] if isinstance(v, str) else v
            if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
                raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings, got {v!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
            ):
                raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            if vocab_size is not None and any(t < 0 or t >= vocab_size for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must lie in [0, {vocab_size})")
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            bad = [
                t
                for t in self.logit_bias
                if not isinstance(t, int) or (vocab_size is not None and not 0 <= t < vocab_size)
            ]
            if bad:
                raise ValueError(f"logit_bias token id {bad[0]!r} is outside [0, {vocab_size})")
            if not all(
                isinstance(b, (int, float)) and math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS
                for b in self.logit_bias.values()
            ):
                # (a bias past float32's range is infinite once added to the logits: every draw breaks)
                raise ValueError(
                    f"logit_bias values must be finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        for pat in self.stop_regexes:
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"stop_regex {pat!r} is not a valid regex: {e}") from None
        set_grammars = [g for g in _GRAMMAR_FIELDS if getattr(self, g) is not None]
        if len(set_grammars) > 1:
            raise ValueError(f"regex, json_schema and ebnf are mutually exclusive; got {set_grammars}")

    @property
    def grammar_key(self) -> Optional[tuple[str, str]]:
        """(kind, text) of the constraint, or None. JSON keys carry the whitespace mode."""
        if self.regex is not None:
            return ("regex", self.regex)
        if self.json_schema is not None:
            kind = "json_ws" if self.json_whitespace else _JSON_STYLE_KINDS[self.json_style or "natural"]
            return (kind, self.json_schema)
        if self.ebnf is not None:
            return ("ebnf", self.ebnf)
        if self.structural_tag is not None:
            return ("structural_tag", self.structural_tag)
        return None


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    """JSON gives string keys ({"123": 5}); turn them into token ids, naming the field on bad input."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
