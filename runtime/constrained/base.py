"""The grammar-backend interface: compile constraints asynchronously, match tokens per request.

Three objects, each with one job:

- `GrammarBackend` (one per engine; holds the tokenizer's `TokenizerVocab`): turns a constraint
  key `(kind, text)` into a `CompiledGrammar` on a thread pool, so a slow compile never stalls a
  batch. `get_or_compile(key)` returns a `concurrent.futures.Future`; equal keys share one
  compilation (an LRU cache of futures). A compile that runs past `compile_timeout` seconds resolves
  its future with `GrammarCompileTimeout`; the compile itself keeps running and, if it eventually
  succeeds, later requests with the same key get the result. Invalid inputs resolve the future
  with `ValueError` saying what is wrong (and so does the synchronous `validate`).
- `CompiledGrammar` (shared, immutable): the tokenizer-specific automaton plus `warnings`, the
  schema features the backend does not enforce (never dropped silently).
- `GrammarMatcher` (one per request, mutable): `accept_token`, `fill_bitmask`, `is_terminated`,
  `is_completed`, `rollback`, `jump_forward_string`.

Kinds: the JSON kinds name a JSON schema and the layout of its text (`JSON_KINDS`): "json_natural"
(separators ", " and ": ", the way models write JSON; the default of SamplingParams), "json" (compact:
"," and ":"), "json_indent" (xgrammar only: two-space indentation), "json_ws" (free whitespace); then
"regex" and "ebnf" (xgrammar only). A JSON kind whose text is `ANY_JSON` ("$$ANY$$") means any JSON
value.

Module layering (imports go one way): `vocab`, `bitmask` ← `base` (this interface) ← `schema_text`,
`schema_support` ← the backends ← `factory` (`create_grammar_backend`) and `validation` (intake
checks) ← `integration` (the scheduler's side).

Bitmask layout (shared by both backends): int32 tensor (B, ceil(V / 32)); bit j of word w is token
32 * w + j; 1 = allowed. See `bitmask.py` for allocation and in-place application.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, InvalidStateError
from typing import Any, ContextManager, Optional, Sequence

import torch

from .bitmask import bitmask_width
from .vocab import TokenizerVocab

JSON_KINDS = ("json", "json_natural", "json_indent", "json_ws")
GRAMMAR_KINDS = (*JSON_KINDS, "regex", "ebnf")
ANY_JSON = "$$ANY$$"
BACKEND_NAMES = ("xgrammar", "outlines")

GrammarKey = tuple[str, str]

# The longest constraint text compiled, by kind. NOTE: compile time grows with a regex's or grammar's size
# (a 100 KB regex is a long compile on xgrammar) and a compile cannot be interrupted: past its timeout it still
# holds a compile thread. Schemas compile to far smaller grammars than their text; real APIs' schemas
# stay well under these.
MAX_CONSTRAINT_CHARS = {**{kind: 262_144 for kind in JSON_KINDS}, "regex": 65_536, "ebnf": 65_536}


class GrammarCompileError(ValueError):
    """A constraint that cannot be compiled (bad syntax, unsupported feature, ...)."""


class GrammarCompileTimeout(GrammarCompileError):
    """Compilation ran past the backend's compile_timeout."""


def check_key(key: Any) -> GrammarKey:
    """Validate the shape of a grammar key; returns it as a (kind, text) tuple."""
    if not isinstance(key, (tuple, list)) or len(key) != 2:
        raise ValueError(f"grammar key must be a (kind, text) pair, got {key!r}")
    kind, text = key
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"grammar kind must be one of {list(GRAMMAR_KINDS)}, got {kind!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{kind} constraint must be a non-empty string")
    limit = MAX_CONSTRAINT_CHARS[kind]
    if len(text) > limit:
        raise ValueError(
            f"the {kind} constraint is {len(text):,} characters long, over the {limit:,} plait "
            f"compiles; split it or describe the format more compactly"
        )
    return (kind, text)


class _DaemonPool:
    """A minimal thread pool of daemon threads.

    NOTE: not concurrent.futures.ThreadPoolExecutor: its threads are joined at interpreter exit,
    so one runaway compile (outlines can take minutes) would hang engine shutdown. A compile
    cannot be interrupted, but with daemon threads it no longer outlives the process."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._closed = False
        for i in range(num_threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        if self._closed:
            fut.set_exception(RuntimeError("the grammar backend was shut down"))
        else:
            self._tasks.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # delivered to the waiter, never lost
                fut.set_exception(e)

    def shutdown(self, num_threads: int) -> None:
        self._closed = True
        for _ in range(num_threads):
            self._tasks.put(None)


class GrammarMatcher(ABC):
    """Per-request matching state. Not thread-safe: one request, one scheduler thread."""

    # Constraint features the backend does not enforce (copied from the CompiledGrammar).
    warnings: tuple[str, ...] = ()
    # Why the output was closed before the model ended it: "budget" | "repetition" (request_grammar.py).
    closed_early: Optional[str] = None

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it.

        Accepting a stop token where the grammar may end terminates the matcher."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted at a point where the grammar may end."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True where the grammar may end now (a stop token would be accepted), terminated or not."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into `bitmask[row]` (int32 CPU tensor, (B, W))."""

    def refine_bitmask(self, logits: torch.Tensor, row: torch.Tensor) -> None:
        """After `fill_bitmask`: narrow the row's (W,) bits further by its (V,) logits (a matcher that must
        choose among the model's likeliest tokens, see request_grammar.py). Default: nothing to narrow."""
        return None

    @property
    def wants_logits(self) -> bool:
        """Whether `refine_bitmask` would read the logits at this point (else it leaves the bits as they are)."""
        return False

    @property
    def max_rollback(self) -> int:
        """How many accepted tokens `rollback` can undo (0: unsupported)."""
        return 0

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not support rollback")

    def jump_forward_string(self) -> Optional[str]:
        """The text the grammar forces next (every valid continuation starts with it), or None."""
        return None

    # ---- speculative decoding (runtime/speculative/) ----
    def draft_room(self, num_tokens: int, free: bool) -> int:
        """How many of `num_tokens` drafts may be scored ahead of the output with this grammar's masks alone
        (`free`: drafts other than the grammar's forced text; a matcher that steers by its budget allows
        fewer near the budget's end). Default: all."""
        return num_tokens

    def keeps_verified(self, token_id: int) -> bool:
        """Before a verified draft's target token (the model's likeliest under this state's mask) is
        committed: whether plain decoding would write it here (a matcher that steers by its budget may
        not: request_grammar.py). Default: always."""
        return True

    def drafting(self) -> ContextManager[None]:
        """A context for walking the matcher through drafts (states the output may never reach): a
        matcher that makes decisions as it fills masks (request_grammar.py) makes none inside it."""
        return contextlib.nullcontext()


class CompiledGrammar(ABC):
    """A grammar compiled against one tokenizer; immutable and shared by all requests with its key."""

    def __init__(self, key: GrammarKey, warnings: Sequence[str], compile_seconds: float) -> None:
        self.key = key
        self.warnings: tuple[str, ...] = tuple(warnings)
        self.compile_seconds = compile_seconds

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start state."""


class GrammarBackend(ABC):
    """Compiles and caches grammars for one tokenizer; subclasses implement `_compile`/`validate`."""

    name: str = "?"

    def __init__(
        self, vocab: TokenizerVocab, num_threads: int = 1, compile_timeout: float = 60.0, cache_size: int = 1024
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if compile_timeout <= 0:
            raise ValueError(f"compile_timeout must be > 0 seconds, got {compile_timeout}")
        self.vocab = vocab
        self.num_threads = num_threads
        self.compile_timeout = float(compile_timeout)
        self.cache_size = cache_size
        self._pool = _DaemonPool(num_threads, f"grammar-{self.name}")
        self._cache: "collections.OrderedDict[GrammarKey, Future]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0
        self.compile_seconds = 0.0  # wall seconds of every compile that ran on the pool (ended or failed)

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    # ---- to implement ----
    @abstractmethod
    def validate(self, kind: str, text: str) -> list[str]:
        """Tokenizer-free check; raises ValueError, returns warnings (unenforced features)."""

    @abstractmethod
    def _compile(self, kind: str, text: str, warnings: list[str]) -> CompiledGrammar:
        """Compile (runs on the pool); raise ValueError for invalid input."""

    # ---- shared machinery ----
    def compile_sync(self, key: GrammarKey) -> CompiledGrammar:
        """Compile on the calling thread, bypassing the cache and the timeout (tests, benchmarks)."""
        kind, text = check_key(key)
        warnings = self.validate(kind, text)
        compiled = self._compile(kind, text, warnings)
        _check_not_empty(compiled, self.vocab_size)
        return compiled

    def get_or_compile(self, key: GrammarKey) -> "Future[CompiledGrammar]":
        """A future of the compiled grammar; cached by key, compiled on the thread pool."""
        kind, text = key = check_key(key)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return fut
            self.cache_misses += 1
            outer: Future = Future()
            self._cache[key] = outer
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        inner = self._pool.submit(self._timed_compile, key)
        timer = threading.Timer(self.compile_timeout, self._on_timeout, args=(key, outer))
        timer.daemon = True
        timer.start()
        inner.add_done_callback(lambda f: self._on_compiled(key, outer, f, timer))
        return outer

    def _timed_compile(self, key: GrammarKey) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            return self.compile_sync(key)
        finally:
            with self._lock:
                self.compile_seconds += time.perf_counter() - start

    def _on_timeout(self, key: GrammarKey, outer: Future) -> None:
        kind, text = key
        snippet = text if len(text) <= 80 else text[:77] + "..."
        err = GrammarCompileTimeout(
            f"compiling the {kind} constraint {snippet!r} with the {self.name} backend took longer "
            f"than grammar_compile_timeout={self.compile_timeout:g}s; simplify the constraint or "
            f"raise the timeout"
        )
        try:
            outer.set_exception(err)
        except InvalidStateError:  # the compile finished at the same instant
            pass

    def _on_compiled(self, key: GrammarKey, outer: Future, inner: Future, timer: threading.Timer) -> None:
        timer.cancel()
        exc = inner.exception()
        try:
            if exc is not None:
                outer.set_exception(
                    exc
                    if isinstance(exc, ValueError)
                    else GrammarCompileError(f"{self.name} failed to compile the {key[0]} constraint: {exc}")
                )
            else:
                outer.set_result(inner.result())
            return
        except InvalidStateError:  # the deadline passed first
            pass
        if exc is None:
            # NOTE: the compile finished after its deadline; later requests with this key get it
            # at once instead of being refused until the cache entry is evicted.
            done: Future = Future()
            done.set_result(inner.result())
            with self._lock:
                if self._cache.get(key) is outer:
                    self._cache[key] = done

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.cache_hits,
                "misses": self.cache_misses,
                "size": len(self._cache),
                "compile_seconds": self.compile_seconds,
            }

    def shutdown(self) -> None:
        self._pool.shutdown(self.num_threads)


def _check_not_empty(compiled: CompiledGrammar, vocab_size: int) -> None:
    """Raise ValueError if the grammar allows no first token, not even a stop token.

    NOTE: such a grammar (e.g. EBNF `root ::= root`) compiles fine; without this check the
    request would be aborted at its first step with "token 0 violates the request's grammar"."""
    bitmask = torch.full((1, bitmask_width(vocab_size)), -1, dtype=torch.int32)  # (1, W), unpinned
    compiled.new_matcher().fill_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        kind, text = compiled.key
        snippet = text if len(text) <= 80 else text[:77] + "..."
        raise GrammarCompileError(
            f"the {kind} constraint {snippet!r} matches no text at all (for example a rule that only refers to itself)"
        )
