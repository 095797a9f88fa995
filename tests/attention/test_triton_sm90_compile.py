"""The attention kernels (split-KV decode, extend, shared prefix) compiled for a Hopper GPU (sm_90) on this
machine: the interpreter runs them here (the other tests in this folder), but only a GPU's compiler rejects
what it cannot lower. Triton's wheel ships the compiler passes and ptxas, so the variants the engine launches
are compiled to cubins here, in a process of its own (the suite runs Triton in interpreter mode);
tests/helpers/compile_sm90.py lists them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parent.parent / "helpers" / "compile_sm90.py"


def _ptxas_shipped() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _ptxas_shipped(), reason="this Triton wheel has no NVIDIA backend with ptxas")
def test_decode_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache of another version
    run = subprocess.run([sys.executable, str(HELPER)], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith(("ok ", "FAILED "))]
    assert lines and not [line for line in lines if line.startswith("FAILED")], run.stdout + run.stderr[-2000:]
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(lines) == 24  # decode: 10 stage-1 variants, 4 of each merge; extend: 4; shared prefix: 2
