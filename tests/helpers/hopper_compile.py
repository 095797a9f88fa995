"""Run compile_sm90.py (Triton kernels compiled for a Hopper GPU on the CPU) in a process of its own, outside
the suite's interpreter mode, and read its verdicts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "compile_sm90.py"


def ptxas_shipped() -> bool:
    """Whether this Triton wheel has the NVIDIA backend with its ptxas (what the compile needs)."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists()


def compile_for_hopper(rooms: list[str], cache_dir: Path) -> tuple[list[str], list[str], str]:
    """(variants compiled, variants failed with their errors, the run's output) for the rooms' kernels; the
    compile cache in `cache_dir`, so nothing is found already compiled by another Triton version."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    run = subprocess.run([sys.executable, str(SCRIPT), *rooms], env=env, capture_output=True, text=True, timeout=600)
    ok = [line[3:] for line in run.stdout.splitlines() if line.startswith("ok ")]
    failed = [line[7:] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
    if run.returncode and not failed:
        failed = [f"the script exited {run.returncode}"]
    return ok, failed, run.stdout + run.stderr[-2000:]
