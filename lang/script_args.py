"""The command line SGLang's benchmark and example scripts share (`sglang.test.test_utils`): the flags,
and the backend they name."""

from __future__ import annotations

import argparse
from typing import Any


def add_common_sglang_args_and_parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add SGLang's common script flags (--parallel, --host, --port, --backend, --result-file, ...) and parse."""
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--host", type=str, default="http://127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--backend",
        type=str,
        default="srt",
        help="srt: the server at --host:--port; runtime: an in-process Runtime (plait's); gpt-*: OpenAI",
    )
    parser.add_argument("--device", type=str, default="auto", choices=["auto", "cuda", "rocm", "cpu"])
    parser.add_argument("--result-file", type=str, default="result.jsonl")
    parser.add_argument("--raw-result-file", type=str)
    return parser.parse_args()


def select_sglang_backend(args: argparse.Namespace) -> Any:
    """The backend `--backend` names: `srt` (and `srt-no-parallel`) a RuntimeEndpoint at `--host:--port`,
    `gpt-...` an OpenAI model; plait adds `runtime`, the in-process engine on the default model."""
    from .global_config import global_config

    backend = args.backend
    if backend.startswith("srt"):
        from .backend.runtime_endpoint import RuntimeEndpoint

        if backend == "srt-no-parallel":
            global_config.enable_parallel_encoding = False
        return RuntimeEndpoint(f"{args.host}:{args.port}")
    if backend.startswith("gpt-"):
        from .backend.openai_backend import OpenAI

        return OpenAI(backend)
    if backend == "runtime":
        from .backend.engine_backend import Runtime

        return Runtime()
    raise ValueError(f"unknown --backend {backend!r}: srt, srt-no-parallel, runtime or a gpt-* model name")
