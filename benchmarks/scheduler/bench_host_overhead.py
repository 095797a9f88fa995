"""Host (CPU, Python) time per scheduler step at large batch, with a tiny model whose forward is negligible.

At batch 256-512 a decode step of a 1B model takes ~4 ms on an H200; everything the scheduler does in
Python around it (building the batch, uploads, reading sampled tokens, stop checks, detokenization,
radix inserts, output messages) must stay well under that for the GPU to stay busy. This bench makes
that host work visible:

1. In-process: the real `Scheduler` stepped directly (as tests/scheduler/test_scheduler_state.py does) on a tiny
   random Llama (2 layers, hidden 64 on the CPU and 256 on a GPU, vocabulary `--vocab`) with the
   embedded SmolLM2's tokenizer, so detokenization costs what it costs with a real model
   (`--no-tokenizer` mirrors the GPU benchmarks' dummy weights: token ids only). On the CPU the
   transformer layers are replaced by random hidden states (see DeviceTimer; `--real-forward` runs
   them); the forward, logits, greedy argmax and attention metadata are timed and subtracted: host ms
   = step ms - forward ms. Each step also pays for pickling its output message, as the scheduler
   process does. Decode steps are bucketed by batch size; host ms is the median over "overlapped"
   steps (each launches the next decode step, then processes the one in flight: the steady state).
   A "drain" processes one without launching the next (a GPU would idle meanwhile); a cProfile (top 25, cumulative)
   covers decode steps at a large
   batch.
2. End to end: an `Engine` (scheduler process + tokenizer manager + ZMQ) runs the same workload. On a
   GPU its output tokens/s is the host-bound throughput; on the CPU the real tiny forward (attention
   over 512 contexts of up to 1,300 tokens) dominates it.

    .venv/bin/python benchmarks/scheduler/bench_host_overhead.py                   # CPU, both parts (~1-2 min)
    .venv/bin/python benchmarks/scheduler/bench_host_overhead.py --device cuda     # on a GPU: the real overlap path

On the CPU the overlap schedule is forced on (the GPU's code path; on the CPU its forward simply runs
synchronously) unless `--no-overlap`.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pickle
import platform
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import load_workload_module, save  # noqa: E402

BUCKETS = ((1, 64), (65, 128), (129, 256), (257, 384), (385, 512))


def make_tiny_model(folder: str, with_tokenizer: bool, vocab: int, head_dim: int = 16) -> str:
    """A config-only Llama (dummy weights at load) + optionally the default model's tokenizer.

    4 query heads of `head_dim` (16 on the CPU; 64 on a GPU, a head size its kernels are tuned for)."""
    tok_src = None
    if with_tokenizer:
        from plait.runtime.models.default_model import default_model_path

        tok_src = default_model_path()
        # NOTE: a model vocabulary smaller than the tokenizer's is fine: every id below it decodes.
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tok_src, name), os.path.join(folder, name))
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=head_dim,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def engine_kwargs(args) -> dict:
    kw = dict(max_running_requests=args.max_running_requests, max_total_tokens=args.max_total_tokens)
    if args.device == "cuda":  # every decode batch a graph replay: the forward stays negligible
        kw["cuda_graph_max_bs"] = args.max_running_requests
    return kw


def make_workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    spec = [(rng.randint(100, 1000), rng.randint(50, 300)) for _ in range(n)]
    return [([rng.randrange(100, vocab) for _ in range(n_in)], n_out) for n_in, n_out in spec]


def shared_workload(name: str, vocab: int) -> list[tuple[list[int], int]]:
    """The fixed GPU workloads of shared/bench/workload.py (as bench_offline.py loads them), with ids
    folded into [100, vocab).

    NOTE: the ids themselves cost nothing on the host; a small vocabulary keeps the (B, vocab) logits of
    the CPU forward from flushing the caches the host work then runs in."""
    workload = load_workload_module()
    return [([100 + (t - 100) % (vocab - 100) for t in ids], n) for ids, n in workload.make(name)]


def sampling(n_out: int) -> dict:
    return {"max_new_tokens": n_out, "ignore_eos": True, "temperature": 0}


class DeviceTimer:
    """Times the device-side work of a step (model forward, logits, attention metadata, greedy argmax)
    so it can be subtracted from the step's wall time. On a GPU nothing is replaced: those calls return
    at launch, and with this model the step is host work anyway.

    With `stub=True` (the CPU default) the transformer layers and the attention metadata are skipped
    and the forward returns seeded random hidden states (the logits, and so the sampled tokens, stay
    varied). NOTE: the real CPU forward at batch 512 streams ~100 MB of KV per step through the
    caches, which then makes the host work after it look slower than it is on a GPU machine.
    """

    def __init__(self, model_runner, stub: bool):
        self.seconds = 0.0
        self.profiler = None  # a cProfile.Profile while one is collecting
        mr = model_runner
        model, backend = mr.model, mr.memory.attn_backend
        timer = self
        gen = torch.Generator().manual_seed(0)
        hidden_size = mr.model_config.hidden_size

        def random_hidden(input_ids, positions, fb):
            return torch.randn(input_ids.shape[0], hidden_size, generator=gen)  # (T, hidden)

        forward = random_hidden if stub else model

        class TimedModel:
            def __call__(self, *a, **k):
                return timer.timed(forward, *a, **k)

            def compute_logits(self, *a, **k):
                return timer.timed(model.compute_logits, *a, **k)

            def __getattr__(self, name):
                return getattr(model, name)

        init = (lambda fb: None) if stub else backend.init_forward_metadata

        def timed_init(fb):
            return timer.timed(init, fb)

        argmax = torch.argmax

        def timed_argmax(*a, **k):
            return timer.timed(argmax, *a, **k)

        self._restore = lambda: None
        if mr.info.device != "cuda":
            mr.forward.model = TimedModel()
            backend.init_forward_metadata = timed_init
            # NOTE: the greedy argmax over the logits is device work on a GPU: not host time.
            torch.argmax = timed_argmax
            self._restore = lambda: setattr(torch, "argmax", argmax)

    def restore(self) -> None:
        self._restore()

    def timed(self, fn, *a, **k):
        # NOTE: the profiler (when on) pauses here too, so its table shows host work only.
        if self.profiler is not None:
            self.profiler.disable()
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t
            if self.profiler is not None:
                self.profiler.enable()

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def step_kind(in_flight_before: bool, in_flight_after) -> str:
    """overlapped: processed a step while the next one ran; drain: processed one with nothing launched
    after it (the device idles meanwhile); launch: only launched one; sync: ran and processed one."""
    if in_flight_before:
        return "overlapped" if in_flight_after is not None else "drain"
    return "launch" if in_flight_after is not None else "sync"


class GcClock:
    """Seconds spent in the garbage collector (gc callbacks) since the last `take`."""

    def __init__(self):
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def run_in_process(args, model_dir: str, reqs) -> dict:
    from plait.runtime.io_struct import BatchOut, TokenizedGenerateReq
    from plait.runtime.request_options import RequestOptions
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler import process
    from plait.runtime.scheduler.scheduler import create_scheduler
    from plait.runtime.server_args import ServerArgs

    sa = ServerArgs(
        model_path=model_dir,
        load_format="dummy",
        device=args.device,
        **engine_kwargs(args),
        disable_overlap_schedule=args.no_overlap,
    )
    s = create_scheduler(sa, model_dir)
    # As the scheduler process does after start-up (absent in older versions, kept comparable).
    getattr(process, "freeze_startup_heap", lambda: None)()
    if args.device == "cpu":
        s.pipeline.overlap = not args.no_overlap  # exercise the GPU's overlap code path (synchronous here)
    timer = DeviceTimer(s.runner, stub=args.device == "cpu" and not args.real_forward)
    for i, (ids, n_out) in enumerate(reqs):
        s.handle_message(TokenizedGenerateReq(ids, SamplingParams(**sampling(n_out)), RequestOptions(rid=f"r{i}")))

    steps = []  # (mode, batch size, step seconds, device seconds, kind: see step_kind)
    gc_s = []  # garbage-collection seconds per step
    gc_clock = GcClock()
    stats = None  # merged cProfile stats of decode steps at a large batch
    profiled = 0
    finished = 0
    t_start = time.perf_counter()
    while not s.is_idle():
        big = len(s.queues.running) >= min(args.profile_at, args.max_running_requests)
        profiler = cProfile.Profile() if big and profiled < args.profile_steps else None
        timer.take()
        gc_clock.take()
        if profiler is not None:
            timer.profiler = profiler
            profiler.enable()
        in_flight = s.pipeline.pending is not None
        t = time.perf_counter()
        batch = s.step()
        outs = s.collect_outputs()
        if outs:
            pickle.dumps(BatchOut(outs), protocol=pickle.HIGHEST_PROTOCOL)  # what send_pyobj does
        dt = time.perf_counter() - t
        if profiler is not None:
            profiler.disable()
            timer.profiler = None
            if batch is not None and batch.mode.is_decode():
                profiled += 1
                if stats is None:
                    stats = pstats.Stats(profiler, stream=io.StringIO())
                else:
                    stats.add(profiler)
        finished += sum(o.finished_reason is not None for o in outs)
        if batch is not None:
            steps.append((batch.mode.name, len(batch.reqs), dt, timer.take(), step_kind(in_flight, s.pipeline.pending)))
            gc_s.append(gc_clock.take())
    wall = time.perf_counter() - t_start
    timer.restore()
    gc_clock.stop()
    s.check_integrity()
    assert s.last_integrity_error is None, s.last_integrity_error
    assert finished == len(reqs), (finished, len(reqs))

    out_tokens = sum(n for _, n in reqs)
    device_s = sum(d for _, _, _, d, _ in steps)
    by_bucket: dict[str, dict] = {}
    overlapped_only = any(kind == "overlapped" for *_, kind in steps)
    for lo, hi in BUCKETS:
        # NOTE: medians over overlapped steps only (launch one + process one: the steady state); the
        # other kinds do half of that work each, and their share changes with the schedule.
        in_bucket = [(mode == "DECODE" and lo <= bs <= hi, kind) for mode, bs, *_, kind in steps]
        rows = [(dt, dev, kind) for (ok, _), (_, _, dt, dev, kind) in zip(in_bucket, steps) if ok]
        gcs = [g for (ok, kind), g in zip(in_bucket, gc_s) if ok and kind == "overlapped"]
        decode_steps, overlapped = len(rows), sum(kind == "overlapped" for *_, kind in rows)
        rows = [row for row in rows if row[2] == "overlapped"] if overlapped_only else rows
        if not rows:
            continue
        by_bucket[f"{lo}-{hi}"] = {
            "decode_steps": decode_steps,
            "overlapped_steps": overlapped,
            "host_ms_median": 1e3 * statistics.median(dt - dev for dt, dev, _ in rows),
            "forward_ms_median": 1e3 * statistics.median(dev for _, dev, _ in rows),
            "step_ms_median": 1e3 * statistics.median(dt for dt, _, _ in rows),
            "gc_ms_mean": 1e3 * statistics.mean(gcs) if gcs else 0.0,
        }
    prefill = [(dt, dev) for mode, _, dt, dev, _ in steps if mode == "EXTEND"]
    stream = io.StringIO()
    if stats is not None:
        stats.stream = stream
        stats.sort_stats("cumulative").print_stats(25)
    return {
        "overlap": s.pipeline.overlap,
        "stub_forward": args.device == "cpu" and not args.real_forward,
        "steps": len(steps),
        "wall_s": wall,
        "device_s": device_s,
        "step_kinds": {k: sum(kind == k for *_, kind in steps) for k in ("overlapped", "drain", "launch", "sync")},
        "output_tok_s": out_tokens / wall,
        "host_only_output_tok_s": out_tokens / max(wall - device_s, 1e-9),
        "decode": by_bucket,
        "prefill": {"steps": len(prefill), "host_ms_median": 1e3 * statistics.median(dt - d for dt, d in prefill)}
        if prefill
        else {},
        "profile_steps": profiled,
        "profile_top25": stream.getvalue(),
        # every step: (mode, batch size, host ms, forward ms, kind)
        "step_rows": [(m, bs, round(1e3 * (dt - dev), 3), round(1e3 * dev, 3), kind) for m, bs, dt, dev, kind in steps],
    }


def run_engine(args, model_dir: str, reqs) -> dict:
    from plait.runtime import Engine

    with Engine(
        model_path=model_dir,
        load_format="dummy",
        device=args.device,
        num_threads=args.threads,
        log_level="warning",
        **engine_kwargs(args),
    ) as eng:
        eng.generate(input_ids=[r[0] for r in reqs[:4]], sampling_params=sampling(4))  # warm-up
        eng.flush_cache()
        t = time.perf_counter()
        outs = eng.generate(input_ids=[r[0] for r in reqs], sampling_params=[sampling(n) for _, n in reqs])
        dt = time.perf_counter() - t
        assert eng.check_integrity()
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    assert all(len(o["output_ids"]) == n for o, (_, n) in zip(outs, reqs))
    return {"seconds": dt, "output_tokens": out_tokens, "output_tok_s": out_tokens / dt}


def print_table(res: dict) -> None:
    ip = res.get("in_process")
    if ip:
        print(
            f"\nin-process scheduler ({'overlap' if ip['overlap'] else 'plain'} path), {ip['steps']} steps, "
            f"{ip['wall_s']:.1f} s wall, {ip['device_s']:.1f} s forward"
        )
        print(
            f"{'decode batch':>13} {'steps':>6} {'overlapped':>10} {'host ms':>8} {'fwd ms':>7} {'step ms':>8} "
            f"{'gc ms':>6} {'host us/req':>11}"
        )
        for name, b in ip["decode"].items():
            hi = int(name.split("-")[1])
            print(
                f"{name:>13} {b['decode_steps']:>6} {b['overlapped_steps']:>10} {b['host_ms_median']:>8.2f} "
                f"{b['forward_ms_median']:>7.2f} {b['step_ms_median']:>8.2f} {b['gc_ms_mean']:>6.2f} "
                f"{1e3 * b['host_ms_median'] / hi:>11.1f}"
            )
        if ip["prefill"]:
            print(f"{'prefill':>13} {ip['prefill']['steps']:>6} {ip['prefill']['host_ms_median']:>8.2f}")
        kinds = ", ".join(f"{k} {n}" for k, n in ip["step_kinds"].items())
        print(f"steps: {kinds}")
        print(f"in-process: {ip['output_tok_s']:.0f} out tok/s; host work only: {ip['host_only_output_tok_s']:.0f}")
    e = res.get("engine")
    if e:
        print(
            f"Engine.generate end to end: {e['output_tokens']} tokens in {e['seconds']:.1f} s = "
            f"{e['output_tok_s']:.0f} out tok/s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--workload",
        default="mixed",
        choices=["mixed", "offline"],
        help="mixed: --num-requests of input 100-1000, output 50-300; offline: bench_offline's 1,000",
    )
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--max-running-requests", type=int, default=512)
    p.add_argument("--max-total-tokens", type=int, default=800_000)
    p.add_argument("--no-tokenizer", action="store_true", help="token ids only (as the GPU dummy-weight runs)")
    p.add_argument(
        "--vocab",
        type=int,
        default=8192,
        help="model vocabulary (host work does not depend on it; the CPU forward does)",
    )
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument(
        "--real-forward",
        action="store_true",
        help="CPU in-process: run the real tiny forward instead of random hidden states",
    )
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--profile-at", type=int, default=400, help="profile decode steps at >= this many running")
    p.add_argument("--profile-steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--tag", default="", help="suffix of the saved JSON name")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    if not args.no_tokenizer:
        try:
            from plait.runtime.models.default_model import default_model_path

            default_model_path()
        except Exception as e:  # e.g. a GPU machine without the embedded model's package
            print(f"no tokenizer available ({type(e).__name__}: {e}); running with --no-tokenizer")
            args.no_tokenizer = True
    folder = tempfile.mkdtemp(prefix="plait-tiny-")
    try:
        vocab = args.vocab
        model_dir = make_tiny_model(folder, not args.no_tokenizer, vocab, 64 if args.device == "cuda" else 16)
        reqs = (
            make_workload(args.num_requests, vocab)
            if args.workload == "mixed"
            else shared_workload(args.workload, vocab)
        )
        res = {
            "bench": "host_overhead",
            "workload": args.workload,
            "device": args.device,
            "machine": platform.node(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "tokenizer": not args.no_tokenizer,
            "vocab": vocab,
            "requests": len(reqs),
            "input_tokens": sum(len(i) for i, _ in reqs),
            "output_tokens": sum(n for _, n in reqs),
            "max_running_requests": args.max_running_requests,
            "torch_threads": args.threads,
        }
        if not args.skip_in_process:
            res["in_process"] = run_in_process(args, model_dir, reqs)
            print(res["in_process"]["profile_top25"])
        if not args.skip_engine:
            res["engine"] = run_engine(args, model_dir, reqs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_table(res)
    name = (
        f"{args.device}{'' if args.workload == 'mixed' else '_' + args.workload}{'_notok' if args.no_tokenizer else ''}"
    )
    save(f"bench_host_overhead_{name}{args.tag}", res)


if __name__ == "__main__":
    main()
