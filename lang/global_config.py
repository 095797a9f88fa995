"""`plait.global_config`: the frontend's user-facing settings (SGLang's `global_config`).

This is the one piece of process-wide state the DSL keeps, because SGLang programs set
`global_config.default_backend` (through `set_default_backend`) and expect every later `run()` to
use it. Nothing in the runtime reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class GlobalConfig:
    # 0: quiet; 2: print each program's final text after run().
    verbosity: int = 0
    default_backend: Optional[Any] = None
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    # run_batch: trace the program, and prefill the text every run starts with once, up front.
    enable_precache_with_tracing: bool = True
    # run_batch with program hints on: prefill and pin the batch's shared segments up front (batch_plan.py).
    # "auto": only where the batch's distinct tokens fill more than half the runtime's KV pool; below that
    # the runtime's prefix cache shares the segments on its own, and the up-front prefill only delays the
    # programs (benchmarks/RESULTS.md, paper_programs: 0.25-0.75x on an H100 where it ran with room to
    # spare). "always" / "never".
    batch_prefill: str = "auto"
    # Accepted for SGLang compatibility; plait joins forks by text.
    enable_parallel_encoding: bool = True


global_config = GlobalConfig()
