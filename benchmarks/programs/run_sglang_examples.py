"""Run SGLang's `examples/frontend_language` programs on plait, each with only its import and model lines
changed, and report which ran to the end (docs/sglang_examples.md lists every program and why the others
do not run here).

    python benchmarks/programs/run_sglang_examples.py --examples PATH/TO/sglang/examples/frontend_language

The changes, and nothing else: `sglang` becomes `plait` in imports; `sgl.Runtime(model_path=...)` and
`sgl.RuntimeEndpoint("http://localhost:30000")` become `sgl.Runtime()` (the embedded default model, in
process); each program runs in its own process with a timeout.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

# The text programs that run on the default model (docs/sglang_examples.md: the rest need a VLM, the
# internet, another server, or a large model's answer).
TEXT_PROGRAMS = (
    "quick_start/local_example_complete.py",
    "quick_start/local_example_chat.py",
    "usage/chinese_regex.py",
    "usage/choices_logprob.py",
    "usage/cot_decoding.py",
    "usage/json_decode.py",
    "usage/json_logprobs.py",
    "usage/multi_stage_fork.py",
    "usage/parallel_sample.py",
    "usage/readme_examples.py",
    "usage/sgl_gen_min_tokens.py",
    "usage/srt_engine.py",
    "usage/streaming.py",
)

_CHANGES = (
    (re.compile(r"^import sglang as sgl$", re.M), "import plait as sgl"),
    (re.compile(r"^import sglang\b", re.M), "import plait"),
    (re.compile(r"^from sglang\b", re.M), "from plait"),
    (re.compile(r"sgl\.Runtime\(\s*model_path=[^)]*\)", re.S), "sgl.Runtime()"),
    (re.compile(r"sgl\.RuntimeEndpoint\(\s*\"http://localhost:\d+\"\s*\)"), "sgl.Runtime()"),
    (re.compile(r"sgl\.Engine\(\s*model_path=[^)]*\)", re.S), "sgl.Engine()"),
)


def adapted(source: str) -> str:
    """The program with only its import and model lines changed."""
    for pattern, replacement in _CHANGES:
        source = pattern.sub(replacement, source)
    return source


def run(path: str, timeout: float) -> tuple[bool, str]:
    with open(path) as f:
        source = adapted(f.read())
    with tempfile.TemporaryDirectory() as folder:
        program = os.path.join(folder, os.path.basename(path))
        with open(program, "w") as f:
            f.write(source)
        try:
            done = subprocess.run(
                [sys.executable, program], capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(path)
            )
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f} s"
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return done.returncode == 0, "" if done.returncode == 0 else last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", required=True, help="SGLang's examples/frontend_language folder")
    parser.add_argument("--only", nargs="*", help="these programs (paths under --examples) instead of the list")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    failed = 0
    for name in args.only or TEXT_PROGRAMS:
        path = os.path.join(args.examples, name)
        if not os.path.exists(path):
            print(f"{name}: not in --examples")
            continue
        ok, why = run(path, args.timeout)
        failed += not ok
        print(f"{name}: {'ran to the end' if ok else 'FAILED: ' + why}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
