"""A CPU process never loads Triton: it is a GPU dependency (its import costs start-up time, and its native
bindings print reference-leak noise at a CPU program's exit, as `make demo` showed once a module imported it
at the top)."""

import subprocess
import sys

# The modules a CPU engine, its scheduler process and the server import.
MODULES = [
    "plait",
    "plait.runtime",
    "plait.runtime.executor.model_runner",
    "plait.runtime.scheduler.scheduler",
    "plait.runtime.models.llama",
    "plait.runtime.models.llava",
    "plait.runtime.lora.matmul",
    "plait.runtime.quant.apply",
    "plait.runtime.kvcache.hiradix_cache",
    "plait.runtime.server.http_server",
]


def test_the_cpu_engine_modules_do_not_import_triton():
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in MODULES)
    code += "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
