"""CompileWatch (runtime/executor/compile_watch.py): a kernel compiled after start-up is counted, named in the
stats, and logged with its compile key (the variant: each argument's specialization), as Triton's post-compile
hook passes it. The hook itself only runs on a GPU (tests/scheduler/test_gpu_first_use.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from plait.runtime.executor.compile_watch import CompileWatch


def test_a_late_compile_is_counted_named_and_logged_with_its_key(caplog):
    watch = CompileWatch()
    watch._t0 = 0.0
    key = (("*bf16", "D"), ("i32", "1"), ("i32", ""), ("constexpr", 128))
    with caplog.at_level(logging.INFO, logger="plait.compile_watch"):
        watch._on_compile(
            key=key,
            repr="_decode_stage1_kernel[num_warps=4](Q: ...)",
            fn=SimpleNamespace(name="_decode_stage1_kernel"),
            compile={"key": key, "signature": {}},
            is_manual_warmup=False,
            already_compiled=False,
        )
    assert watch.stats() == {
        "kernel_compiles_after_startup": 1,
        "kernels_compiled_after_startup": ["_decode_stage1_kernel"],
    }
    assert "_decode_stage1_kernel" in caplog.text and "('i32', '1')" in caplog.text
