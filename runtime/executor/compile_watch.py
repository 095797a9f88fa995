"""Counts the Triton kernels compiled after start-up.

Start-up (the prefill warm-up, CUDA-graph capture) is meant to compile every kernel variant a request
can take. A variant first met by a user's batch is compiled while that batch waits: hundreds of
milliseconds on a fresh machine, seen as a slow first round or a TTFT spike. Triton compiles a new
variant for each new set of constexpr values and for each new specialization of an integer argument
(equal to 1, divisible by 16), so a warm-up that missed one is easy to write and hard to see. This
watch makes it visible: the scheduler reports the count in its stats and logs each one.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("plait.compile_watch")


class CompileWatch:
    def __init__(self):
        self.count = 0
        self.seconds_after_start = []  # when each compile finished, from start()
        self.names: list[str] = []
        self._t0 = None
        self._chained = None

    def start(self) -> bool:
        """Installs the hook (chained after any hook already there). False where Triton has no hook API."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        self._chained = runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = self._on_compile
        self._t0 = time.perf_counter()
        return True

    def _on_compile(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        self.count += 1
        self.seconds_after_start.append(time.perf_counter() - self._t0)
        self.names.append(name)
        # NOTE: the repr names the kernel and its options; which variant it was (each argument's type and
        # specialization: an int that is 1 or a multiple of 16, constexpr values) is in the compile key.
        compiled = kwargs.get("compile")
        logger.info(
            "Triton compiled %s after start-up (%d so far): the batch that needed it waited for the compile; "
            "%s; key %s",
            name,
            self.count,
            kwargs.get("repr", ""),
            compiled.get("key") if isinstance(compiled, dict) else kwargs.get("key"),
        )
        if self._chained is not None:
            return self._chained(*args, **kwargs)
        return None

    def stats(self) -> dict:
        return {"kernel_compiles_after_startup": self.count, "kernels_compiled_after_startup": sorted(set(self.names))}
