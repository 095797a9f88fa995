"""Does the HTTP side keep up? `plait serve` on a micro model whose decode step is cheap, so the scheduler
produces tokens for hundreds of streams faster than a real model would on this machine, and the server
process (detokenizing, JSON, the event loop, the hand-off between threads) is what is measured.

    python benchmarks/serving/http_load.py                         # 800 prompts, 400 streams, openai
    python benchmarks/serving/http_load.py --profile /tmp/prof     # + py-spy (pip install py-spy) of both processes
    python benchmarks/serving/http_load.py --runs 3 --tag after    # repeat; medians of the runs
    python benchmarks/serving/http_load.py --model DIR --input-len 512 --num-prompts 400 --max-concurrency 0 \
        --request-rate 64 --request-rate inf                       # a real shape on a GPU (DIR: config + tokenizer)

The micro model is a Llama of hidden 64 (`--layers`, default 1) with the embedded default model's
tokenizer and the first `--vocab` tokens of its vocabulary (4,096: the LM head and the argmax over all
49,152 were most of a CPU step at batch 400), dummy weights. The server runs with one torch thread and
`--max-running-requests 512`; the client is bench_serving.py (`--backend openai`, random 64 in / 128 out,
unbounded rate, `--max-concurrency`). What to read: ITL median against TPOT median. A server that keeps up
sends each token in its own chunk as it comes (ITL median near TPOT median); one that falls behind sends
several chunks in one burst, then nothing (ITL median near 0, a long ITL p99). Server and scheduler CPU
per chunk / token (from /proc) are the steadiest figures on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_serving  # noqa: E402
from bench_common import save  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_micro_llama(
    folder: str, hidden: int = 64, layers: int = 1, vocab: Optional[int] = None, context: int = 2048
) -> str:
    """A Llama config of `hidden` x `layers` with the default model's tokenizer files (load it with
    load_format="dummy": no weights are written). `vocab`: the model's first `vocab` tokens of the
    tokenizer's (None: all of them); at a large batch the LM head and the argmax over the whole
    vocabulary are most of a CPU step."""
    from plait.runtime.models.default_model import default_model_path

    source = default_model_path()
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    heads = max(1, hidden // 32)
    config.update(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=context,
    )
    if vocab:
        config["vocab_size"] = min(vocab, config["vocab_size"])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), folder)
    return folder


def start_server(model: str, port: int, log_path: str, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "plait.runtime.server",
        "--model-path",
        model,
        "--load-format",
        "dummy",
        "--port",
        str(port),
        "--num-threads",
        "1",
        "--max-running-requests",
        "512",
        "--max-total-tokens",
        "262144",
        *extra,
    ]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str, deadline_s: float = 600) -> None:
    import requests

    deadline = time.time() + deadline_s
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            sys.exit(f"the server was not healthy after {deadline_s}s")
        time.sleep(0.5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scheduler_child(pid: int) -> int:
    """The scheduler process the server at `pid` started."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for child in f.read().split():
            with open(f"/proc/{child}/cmdline", "rb") as c:
                if b"plait.runtime.scheduler" in c.read():
                    return int(child)
    raise RuntimeError(f"no scheduler process under pid {pid}")


def start_py_spy(pid: int, path: str) -> subprocess.Popen:
    """py-spy sampling `pid` into `path` (collapsed stacks) until it gets SIGINT."""
    return subprocess.Popen(
        [shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy"), "record"]
        + ["--format", "raw", "-o", path, "--pid", str(pid), "--rate", "100", "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_argv(args: argparse.Namespace, rate: float, port: int, out_file: str) -> list[str]:
    concurrency = ["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []
    return [
        "--backend",
        args.backend,
        "--port",
        str(port),
        "--dataset",
        "random",
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(rate),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--warmup-requests",
        "4",
        "--output-file",
        out_file,
        "--seed",
        str(args.seed),
        "--flush-cache",  # (each rate, each run from a cold cache: the prompts repeat)
        *concurrency,
    ]


KEYS = (
    "median_itl_ms",
    "p99_itl_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "output_token_throughput",
    "tokens_per_chunk",
    "server_cpu_us_per_chunk",
    "scheduler_cpu_us_per_token",
    "failed",
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="plait-http-load-")
    model = args.model or write_micro_llama(os.path.join(workdir, "micro-llama"), layers=args.layers, vocab=args.vocab)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(workdir, "server.log")
    proc = start_server(model, port, log_path, args.server_arg)
    spies: list[subprocess.Popen] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        wait_healthy(proc, url, log_path)
        for rate in args.request_rate or [float("inf")]:
            for i in range(args.runs):
                scheduler_pid = scheduler_child(proc.pid)
                if args.profile and i == args.runs - 1:  # the last run, profiled (py-spy slows what it samples)
                    spies = [
                        start_py_spy(pid, f"{args.profile}-{name}.txt")
                        for name, pid in (("server", proc.pid), ("scheduler", scheduler_pid))
                    ]
                cpu_before = cpu_seconds(proc.pid), cpu_seconds(scheduler_pid)
                out_file = os.path.join(workdir, f"rate{rate}-run{i}.json")
                summary = bench_serving.main(bench_argv(args, rate, port, out_file))
                server_cpu, scheduler_cpu = (cpu_seconds(p) - b for p, b in zip((proc.pid, scheduler_pid), cpu_before))
                tokens, chunks = max(1, summary["total_output_tokens"]), max(1, summary["total_chunks"])
                summary["tokens_per_chunk"] = tokens / chunks
                summary["server_cpu_us_per_chunk"] = 1e6 * server_cpu / chunks
                summary["scheduler_cpu_us_per_token"] = 1e6 * scheduler_cpu / tokens
                runs.setdefault(str(rate), []).append({k: summary.get(k) for k in KEYS})
                for spy in spies:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=60)
                if spies:
                    print(f"profiles (py-spy, collapsed stacks): {args.profile}-server.txt, -scheduler.txt")
                spies = []
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    medians = {}
    for rate, rate_runs in runs.items():
        medians[rate] = {k: statistics.median(r[k] for r in rate_runs if r[k] is not None) for k in KEYS}
        print(f"\n{args.tag or 'run'}, request rate {rate}: medians of {len(rate_runs)} runs")
        for k in KEYS:
            print(f"  {k:<26} {medians[rate][k]:10.3f}   runs: {', '.join(f'{r[k]:.3f}' for r in rate_runs)}")
    result = {"tag": args.tag, "config": {k: v for k, v in vars(args).items()}, "runs": runs, "medians": medians}
    save(f"http_load_{args.tag or 'run'}", result)
    return result


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("plait", "openai"), default="openai")
    p.add_argument("--num-prompts", type=int, default=800)
    p.add_argument("--max-concurrency", type=int, default=400, help="0: none")
    p.add_argument("--request-rate", type=float, action="append", help="req/s (repeatable; default inf)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--model", default=None, help="a model folder (default: the micro Llama, written on the fly)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096, help="the model's vocabulary (0: the tokenizer's whole)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--profile", default=None, help="py-spy the last run: PREFIX-server.txt and PREFIX-scheduler.txt (collapsed)"
    )
    p.add_argument("--server-arg", action="append", default=[], help="one more `plait serve` flag (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the model folder, the server log and each run's JSON")
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
