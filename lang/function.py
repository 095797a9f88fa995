"""SglFunction: what `@plait.function` makes of a Python function whose first parameter is the state."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence, Union

from .gen_params import RunDefaults
from .global_config import global_config
from .run import cache_program, run_program, run_program_batch
from .subprogram import SglSubprogramCall, inside_a_program
from .tracer import TracingScope, trace_program


class SglFunction:
    def __init__(
        self, func: Callable, num_api_spec_tokens: Optional[int] = None, bind_arguments: Optional[dict] = None
    ):
        if not callable(func):
            raise TypeError(f"@function needs a function, got {type(func).__name__}")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens  # each backend says what it makes of it (run.py)
        self.bind_arguments = dict(bind_arguments or {})
        name = getattr(func, "__name__", "program")
        # NOTE: the signature, not getfullargspec: it follows functools.wraps, so a program under a
        # decorator of its own (retries, timing) keeps its parameters instead of the wrapper's *args.
        params = list(inspect.signature(func).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not positional:
            raise TypeError(f"program {name!r} must take the state as its first parameter, e.g. `def {name}(s, ...)`")
        # Keyword-only parameters and *args are the program's too (SGLang passes run()'s extra
        # positional and keyword arguments straight to the body): `def prog(s, q, *, shots=3)`.
        self.positional_names: list[str] = [p.name for p in positional[1:]]
        self.arg_names: list[str] = self.positional_names + [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        self.arg_defaults: Sequence[Any] = tuple(p.default for p in positional[1:] if p.default is not p.empty)
        self.var_args_name: Optional[str] = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        self.takes_var_args = self.var_args_name is not None
        self.takes_var_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
        self.__name__ = name
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"<plait.function {self.__name__}({', '.join(self.arg_names)})>"

    def bind(self, **kwargs: Any) -> "SglFunction":
        """A copy with some arguments fixed: `few_shot_qa.bind(examples=...)`."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}() has no parameter(s) {unknown}; it takes {self.arg_names}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def split_run_kwargs(self, kwargs: dict) -> tuple[dict, dict]:
        """Separate program arguments from sampling defaults (a program parameter's name wins)."""
        program, sampling = {}, {}
        for key, value in kwargs.items():
            if key in self.arg_names:
                program[key] = value
            elif RunDefaults.is_sampling_name(key):
                sampling[key] = value
            elif self.takes_var_kwargs:
                program[key] = value
            else:
                raise TypeError(
                    f"{self.__name__}() got an unexpected argument {key!r}: it is neither a "
                    f"parameter of the program ({self.arg_names}) nor a sampling parameter"
                )
        return program, sampling

    def run(self, *args: Any, stream: bool = False, backend: Any = None, use_thread: bool = True, **kwargs: Any):
        """Run the program once. Keyword arguments are the program's own, or sampling defaults that
        every gen() inherits unless it sets them (`max_new_tokens=128`, `temperature=1.0`, ...)."""
        program_kwargs, sampling = self.split_run_kwargs(kwargs)
        args, program_kwargs = self._call_arguments(args, program_kwargs)
        defaults = RunDefaults.from_kwargs(sampling)
        backend = backend or global_config.default_backend
        return run_program(self, backend, args, program_kwargs, defaults, stream, use_thread=use_thread)

    def _call_arguments(self, args: Sequence[Any], kwargs: dict) -> tuple[tuple, dict]:
        """(positional, keyword) values to call the body with. Positional values fill the positional
        parameters bind() left open, in order, and become keywords (so run_batch, bind() and tracing
        see them by name); past those, a body with *args takes the rest, as Python would."""
        free = [n for n in self.positional_names if n not in self.bind_arguments]
        out = dict(kwargs)
        if len(args) > len(free):
            if not self.takes_var_args:
                raise TypeError(
                    f"{self.__name__}() takes {len(free)} positional argument(s) ({free}) but {len(args)} were given"
                )
            # Python fills every positional parameter before *args: none of them may come by name.
            named = [n for n in self.positional_names if n in out or n in self.bind_arguments]
            if named:
                raise TypeError(
                    f"{self.__name__}() got more positional values than {free}, for "
                    f"*{self.var_args_name}, but {named} by name or bind(): pass those "
                    f"positionally too"
                )
            return tuple(args), out
        for name, value in zip(free, args):
            if name in out:
                raise TypeError(f"{self.__name__}() got multiple values for argument {name!r}")
            out[name] = value
        return (), out

    def run_batch(
        self,
        batch_kwargs: Sequence[Union[dict, Sequence[Any]]],
        *,
        backend: Any = None,
        num_threads: Union[str, int] = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Any,
    ):
        """Run the program once per item (a dict of arguments, or a tuple in parameter order).
        Returns the states in input order (a generator of them with generator_style=True); a program
        that fails has its exception in `state.error()` and does not stop the others."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"run_batch() needs a list of argument dicts or tuples, got {type(batch_kwargs).__name__}")
        arguments = [self._batch_item_kwargs(i, item) for i, item in enumerate(batch_kwargs)]
        for key in sampling:
            if not RunDefaults.is_sampling_name(key):
                raise TypeError(f"run_batch() got an unexpected argument {key!r}")
        defaults = RunDefaults.from_kwargs(sampling)
        backend = backend or global_config.default_backend
        return run_program_batch(self, backend, arguments, defaults, num_threads, progress_bar, generator_style)

    def _batch_item_kwargs(self, index: int, item: Any) -> dict:
        if isinstance(item, dict):
            return dict(item)
        if isinstance(item, (list, tuple)):
            names = self.positional_names
            required = len(names) - len(self.arg_defaults)
            if not required <= len(item) <= len(names):
                raise TypeError(
                    f"run_batch item {index} has {len(item)} values; {self.__name__}() takes "
                    f"{required} to {len(names)} ({names})"
                )
            return dict(zip(names, item))
        raise TypeError(f"run_batch item {index} must be a dict or a tuple, got {type(item).__name__}")

    def trace(self, *args: Any, backend: Any = None, **kwargs: Any):
        """Record the program's expression graph without running a model (see plait.tracer)."""
        kwargs.update(zip(self.positional_names, args))
        return trace_program(self, kwargs, backend or global_config.default_backend)

    def graph(self, *args: Any, backend: Any = None, **kwargs: Any):
        """The program's request graph, by tracing (plait.graph.RequestGraph): text segments, gen and
        select requests, forks and joins, and which requests share which text. Arguments not given
        stay placeholders. Draw it with plait.graph_render (`save(graph, "program.html")`, `to_dot(graph)`)."""
        return self.trace(*args, backend=backend, **kwargs).graph(self.__name__)

    def cache(self, backend: Any = None) -> None:
        """Prefill the text every run of this program starts with."""
        cache_program(self, backend or global_config.default_backend)

    def __call__(self, *args: Any, **kwargs: Any):
        """Outside a program: run it (`prog(x)` is `prog.run(x)`). Inside a running or traced program:
        a call that `s += prog(x)` runs on the caller's state (plait.subprogram)."""
        if inside_a_program() or TracingScope.get_current_scope() is not None:
            return self._subprogram_call(args, kwargs)
        return self.run(*args, **kwargs)

    def _subprogram_call(self, args: Sequence[Any], kwargs: dict):
        program_kwargs, sampling = self.split_run_kwargs(kwargs)
        if sampling:
            raise TypeError(
                f"{self.__name__}() called inside a program takes only its own parameters "
                f"({self.arg_names}); {sorted(sampling)} are sampling settings: set them on "
                f"its gen() calls or on the outer program's run()"
            )
        args, program_kwargs = self._call_arguments(args, program_kwargs)
        program_kwargs = {**program_kwargs, **self.bind_arguments}
        try:  # a missing argument fails here, where the call is written, not mid-program
            inspect.signature(self.func).bind(None, *args, **program_kwargs)
        except TypeError as e:
            raise TypeError(f"{self.__name__}(): {e}") from None
        return SglSubprogramCall(self, program_kwargs, args)
