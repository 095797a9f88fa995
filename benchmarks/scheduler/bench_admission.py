"""Scheduler host time for a few-shot round whose shared prefix is already cached (CPU, tiny model).

The `fewshot` stream on an H200 (256 requests = one shared 2,000-token prefix + 50 unique tokens, 16
output tokens each) keeps the device only ~70% busy: per round the scheduler spends tens of ms in
Python admitting the prefill batches (radix match, allocation, req_to_token rows), taking in the
requests and processing results, and every one of those ms is wall time. This bench reproduces that
host work with the real `Scheduler` stepped in-process (as tests/scheduler/test_scheduler_state.py does) on a
tiny random Llama whose forward is replaced by random hidden states (bench_host_overhead.DeviceTimer),
token ids only (no tokenizer), as the GPU benchmarks run.

Each round: flush the cache, run one warm request (the shared prefix + its own 50 tokens) to the end
so the prefix is cached, then the 256 requests, each message pickled as the tokenizer manager sends it.
Host ms per round, by the scheduler's phases (`get_stats()["steps"]["host_phases"]`):
  intake   unpickling the 256 messages + `handle_message` (as the scheduler process loop does)
  admit    building batches (`_get_prefill_batch` / `_get_decode_batch`)
  results  `_process_result` (tokens, stop checks, radix inserts, releases)
  outputs  `collect_outputs` + pickling the `BatchOut` (what send_pyobj does)
  run      the rest of `ModelRunner.run` (ForwardBatch, host rows, table writes) minus the stubbed forward
Medians over `--rounds` rounds; `--profile` prints a cProfile (tottime) of the timed rounds.

Nothing runs asynchronously on the CPU, so the host work above is all wall time here. `--sim-device`
adds a modeled GPU (`SimulatedDevice`): each launched step keeps it busy for a time from a cost model
(defaults: an H200 running llama-3.1-8b, fitted to bench_rounds' prefill and decode device seconds),
after the step before it, and reading a step back waits for its end (as the event synchronize does).
The stubbed forward's own CPU time is taken off the clock (it is device work on a GPU). The device's
busy share of the wall time then shows how much host work overlap scheduling hides;
`--compare-pipeline` runs the rounds with prefill pipelining off, then on (runtime/scheduler/overlap.py).

    .venv/bin/python benchmarks/scheduler/bench_admission.py                 # ~20 s on this CPU
    .venv/bin/python benchmarks/scheduler/bench_admission.py --profile 30
    .venv/bin/python benchmarks/scheduler/bench_admission.py --workload tree --sim-device --compare-pipeline
"""

from __future__ import annotations

import argparse
import cProfile
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

from bench_common import save  # noqa: E402
from bench_host_overhead import DeviceTimer, GcClock, make_tiny_model  # noqa: E402
from sim_device import SimulatedDevice  # noqa: E402

PHASES = ("intake", "admit", "results", "outputs", "run")


def make_round(rng: random.Random, shared: list[int], n: int, unique: int, vocab: int) -> list[list[int]]:
    return [shared + [rng.randrange(100, vocab) for _ in range(unique)] for _ in range(n)]


def run_round(
    s,
    timer: DeviceTimer,
    prompts: list[list[int]],
    n_out: int,
    rid_prefix: str,
    profiler=None,
    generated: dict | None = None,
    sim: SimulatedDevice | None = None,
) -> dict:
    """Submit `prompts` (pickled messages, as over ZMQ) and step until idle; host seconds per phase.
    With `generated`, each request's output ids are gathered there under its index (outside the timing).
    With `sim`, also the modeled device's busy seconds and the wall time without the stubbed forward."""
    from plait.runtime.io_struct import BatchOut, TokenizedGenerateReq
    from plait.runtime.request_options import RequestOptions
    from plait.runtime.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=n_out, ignore_eos=True, temperature=0)
    wire = [
        pickle.dumps(
            TokenizedGenerateReq(ids, sp, RequestOptions(rid=f"{rid_prefix}{i}")),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        for i, ids in enumerate(prompts)
    ]
    before = dict(s.timer.phases)
    gc_clock = GcClock()
    finished_before = s.stats["num_finished"]
    timer.take()
    if sim is not None:
        sim.take()
    if profiler is not None:
        timer.profiler = profiler
        profiler.enable()
    t0 = time.perf_counter()
    for msg in wire:  # NOTE: the scheduler process receives one message per request: recv_pyobj + handle_message
        s.handle_message(pickle.loads(msg))
    intake = time.perf_counter() - t0
    outputs = stepped = 0.0
    finished = steps = 0
    while not s.is_idle():
        t = time.perf_counter()
        s.step()
        t_out = time.perf_counter()
        outs = s.collect_outputs()
        if outs:
            pickle.dumps(BatchOut(outs), protocol=pickle.HIGHEST_PROTOCOL)
        outputs += time.perf_counter() - t_out
        stepped += t_out - t
        if generated is not None:
            for o in outs:
                generated.setdefault(int(o.rid[len(rid_prefix) :]), []).extend(o.new_ids)
        finished += sum(o.finished_reason is not None for o in outs)
        steps += 1
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        timer.profiler = None
    assert finished == len(prompts), (finished, len(prompts))
    assert s.stats["num_finished"] == finished_before + finished, "a request was aborted"  # not served
    device = timer.take()
    gc_s = gc_clock.take()
    gc_clock.stop()
    admit = s.timer.phases["admit"] - before["admit"]
    results = s.timer.phases["results"] - before["results"]
    res = {
        "intake": intake,
        "admit": admit,
        "results": results,
        "outputs": outputs,
        "run": stepped - admit - results - device,
        "forward_stub": device,
        "gc": gc_s,
        "wall": wall,
        "steps": steps,
    }
    if sim is not None:
        # NOTE: the phases stay host work: waiting for the modeled device while reading a step back
        # (inside "results") or running one synchronously (inside "run") is taken out of them. The
        # wall time that counts leaves out the stubbed forward's CPU time.
        busy, waited = sim.take()
        res["results"] -= waited["resolve"]
        res["run"] -= waited["run"]
        res["sim_device"], res["sim_wait"] = busy, waited["resolve"] + waited["run"]
        res["sim_wall"] = wall - device
        res["sim_idle"] = res["sim_wall"] - busy
    return res


def make_scheduler(folder: str, args):
    """The real Scheduler on a tiny random Llama (CPU, stubbed forward), GC set up as its process does."""
    from plait.runtime.scheduler import process
    from plait.runtime.scheduler.scheduler import create_scheduler
    from plait.runtime.server_args import ServerArgs

    model_dir = make_tiny_model(folder, with_tokenizer=False, vocab=args.vocab)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 4096  # the prompts are up to ~2,050 tokens long
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    sa = ServerArgs(
        model_path=model_dir,
        load_format="dummy",
        device="cpu",
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
    )
    s = create_scheduler(sa, model_dir)
    process.freeze_startup_heap()  # as the scheduler process does after start-up
    s.pipeline.overlap = True  # the GPU's decode path (synchronous on the CPU)
    return s


def check(s) -> None:
    s.check_integrity()
    assert s.last_integrity_error is None, s.last_integrity_error


SIM_KEYS = ("sim_device", "sim_wait", "sim_wall", "sim_idle")


def print_round(name: str, res: dict) -> None:
    sim = (
        f", device {1e3 * res['sim_device']:.1f} of {1e3 * res['sim_wall']:.1f} ms busy" if "sim_device" in res else ""
    )
    print(
        f"{name}: "
        + "  ".join(f"{n} {1e3 * res[n]:.1f}" for n in PHASES)
        + f"  ms (gc {1e3 * res['gc']:.1f}, wall {1e3 * res['wall']:.1f}, {res['steps']} steps{sim})",
        flush=True,
    )


def medians(rounds: list[dict]) -> dict:
    keys = PHASES + ("forward_stub", "gc", "wall") + (SIM_KEYS if "sim_device" in rounds[0] else ())
    return {n: 1e3 * statistics.median(r[n] for r in rounds) for n in keys}


def print_table(med: dict) -> float:
    host = sum(med[n] for n in PHASES)
    print(f"{'phase':>8} {'host ms':>8}")
    for n in PHASES:
        print(f"{n:>8} {med[n]:>8.2f}")
    print(
        f"{'total':>8} {host:>8.2f}   (stubbed forward {med['forward_stub']:.1f} ms, gc "
        f"{med['gc']:.1f} ms, wall {med['wall']:.1f} ms)"
    )
    if "sim_device" in med:
        print(
            f"modeled device: busy {med['sim_device']:.1f} of {med['sim_wall']:.1f} ms "
            f"({100 * med['sim_device'] / med['sim_wall']:.1f}%), idle {med['sim_idle']:.1f} ms"
        )
    return host


def per_round_ms(rounds: list[dict]) -> list[dict]:
    return [{k: 1e3 * v if k != "steps" else v for k, v in r.items()} for r in rounds]


def _flush():
    from plait.runtime.io_struct import FlushCacheReq

    return FlushCacheReq(0)


def bench_fewshot(s, timer: DeviceTimer, args, profiler, sim: SimulatedDevice | None = None) -> dict:
    rng = random.Random(0)
    prefix = 2000 if args.prefix is None else args.prefix
    unique = 50 if args.unique is None else args.unique
    output = 16 if args.output is None else args.output
    shared = [rng.randrange(100, args.vocab) for _ in range(prefix)]
    rounds = []
    for k in range(args.rounds + 1):  # round 0 warms up the code paths and is not counted
        assert s.control.handle(_flush()) is True
        run_round(s, timer, make_round(rng, shared, 1, unique, args.vocab), output, f"w{k}-", sim=sim)
        res = run_round(
            s,
            timer,
            make_round(rng, shared, args.requests, unique, args.vocab),
            output,
            f"r{k}-",
            profiler if k else None,
            sim=sim,
        )
        check(s)
        if k:
            rounds.append(res)
        print_round(f"round {k}", res)
    med = medians(rounds)
    print(
        f"\nfewshot round on the CPU: {args.requests} x ({prefix} shared + {unique}) tokens, "
        f"{output} out; medians of {len(rounds)} rounds"
    )
    host = print_table(med)
    return {
        "bench": "admission",
        "machine": platform.node(),
        "requests": args.requests,
        "prefix": prefix,
        "unique": unique,
        "output": output,
        "rounds": len(rounds),
        "median_ms": med,
        "host_ms_total": host,
        "per_round_ms": per_round_ms(rounds),
    }


def bench_tree(s, timer: DeviceTimer, args, profiler, sim: SimulatedDevice | None = None) -> dict:
    """The `tree` stream of /work/shared/bench/workload.py at the CPU's vocabulary: round 1 = `roots` x
    `branches` requests (a unique root prefix + `unique` tokens), round 2 = `branches` children per
    round-1 request (its whole sequence, generated tokens included, + `unique` tokens), as run_rounds
    builds them; the cache is flushed before each repetition, so round 1 starts cold."""
    prefix = 1000 if args.prefix is None else args.prefix
    unique = 50 if args.unique is None else args.unique
    output = 64 if args.output is None else args.output
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, args.vocab) for _ in range(n)]  # noqa: E731
    per_round: list[list[dict]] = [[], []]
    for k in range(args.rounds + 1):  # repetition 0 warms up the code paths and is not counted
        assert s.control.handle(_flush()) is True
        roots = [ids(prefix) for _ in range(args.roots)]
        r1 = [roots[t] + ids(unique) for t in range(args.roots) for _ in range(args.branches)]
        out1: dict = {}
        res1 = run_round(s, timer, r1, output, f"a{k}-", profiler if k else None, generated=out1, sim=sim)
        check(s)
        assert all(len(out1[i]) == output for i in range(len(r1))), "round 1: an output of the wrong length"
        r2 = [r1[i] + out1[i] + ids(unique) for i in range(len(r1)) for _ in range(args.branches)]
        res2 = run_round(s, timer, r2, output, f"b{k}-", profiler if k else None, sim=sim)
        check(s)
        if k:
            per_round[0].append(res1), per_round[1].append(res2)
        print_round(f"rep {k} round 1", res1)
        print_round(f"rep {k} round 2", res2)
    n1, n2 = args.roots * args.branches, args.roots * args.branches**2
    out = {
        "bench": "admission_tree",
        "machine": platform.node(),
        "roots": args.roots,
        "branches": args.branches,
        "prefix": prefix,
        "unique": unique,
        "output": output,
        "rounds": len(per_round[0]),
        "median_ms": {},
        "host_ms_total": {},
        "per_round_ms": {},
    }
    for name, rounds, n in (("round1", per_round[0], n1), ("round2", per_round[1], n2)):
        med = medians(rounds)
        print(f"\ntree {name} on the CPU: {n} requests, {output} out; medians of {len(rounds)} repetitions")
        out["median_ms"][name], out["per_round_ms"][name] = med, per_round_ms(rounds)
        out["host_ms_total"][name] = print_table(med)
    both = {n: out["median_ms"]["round1"][n] + out["median_ms"]["round2"][n] for n in PHASES}
    print("\nboth rounds: " + "  ".join(f"{n} {both[n]:.1f}" for n in PHASES) + f"  total {sum(both.values()):.1f} ms")
    if sim is not None:
        dev, wall = (sum(out["median_ms"][r][k] for r in ("round1", "round2")) for k in ("sim_device", "sim_wall"))
        print(f"modeled device, both rounds: busy {dev:.1f} of {wall:.1f} ms ({100 * dev / wall:.1f}%)")
    return out


def device_summary(res: dict) -> dict:
    """Both workloads' rounds summed: modeled device busy ms, wall ms (without the stub), host ms."""
    med = res["median_ms"]
    meds = [med] if "sim_device" in med else list(med.values())
    return {k: sum(m[k] for m in meds) for k in ("sim_device", "sim_wall", "sim_idle")} | {
        "host": sum(m[n] for m in meds for n in PHASES)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("fewshot", "tree"), default="fewshot")
    p.add_argument("--requests", type=int, default=256, help="fewshot: requests per round")
    p.add_argument("--roots", type=int, default=32, help="tree: distinct roots")
    p.add_argument("--branches", type=int, default=4, help="tree: children per request and round")
    p.add_argument("--prefix", type=int, default=None, help="shared prefix / root tokens (2000 fewshot, 1000 tree)")
    p.add_argument("--unique", type=int, default=None, help="unique tokens per request (50)")
    p.add_argument("--output", type=int, default=None, help="output tokens per request (16 fewshot, 64 tree)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (tree: repetitions of both rounds)")
    p.add_argument("--max-running-requests", type=int, default=512)
    p.add_argument("--max-total-tokens", type=int, default=400_000)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the top N functions by tottime")
    p.add_argument("--tag", default="", help="suffix of the saved JSON name")
    p.add_argument("--sim-device", action="store_true", help="a modeled GPU behind the stubbed forward")
    p.add_argument(
        "--sim-prefill-us-per-token",
        type=float,
        default=25.0,
        help="modeled prefill time per new token (H200, llama-3.1-8b: ~25 us)",
    )
    p.add_argument("--sim-decode-us-per-row", type=float, default=33.0, help="modeled decode time per request")
    p.add_argument("--sim-step-ms", type=float, default=3.0, help="modeled fixed time of every step")
    p.add_argument(
        "--compare-pipeline",
        action="store_true",
        help="run the rounds with prefill pipelining off, then on (implies --sim-device)",
    )
    args = p.parse_args()
    if args.compare_pipeline:
        args.sim_device = True
    torch.set_num_threads(1)

    folder = tempfile.mkdtemp(prefix="plait-tiny-")
    try:
        s = make_scheduler(folder, args)
        timer = DeviceTimer(s.runner, stub=True)
        profiler = cProfile.Profile() if args.profile else None
        sim = (
            SimulatedDevice(
                s.runner, timer, args.sim_prefill_us_per_token, args.sim_step_ms, args.sim_decode_us_per_row
            )
            if args.sim_device
            else None
        )
        bench = bench_tree if args.workload == "tree" else bench_fewshot
        if args.compare_pipeline:
            res = {"bench": f"{'admission_tree' if args.workload == 'tree' else 'admission'}_pipeline"}
            for on in (False, True):
                s.pipeline.pipeline_prefills = on
                print(f"\n=== prefill pipelining {'on' if on else 'off'} ===")
                res[f"pipeline_{'on' if on else 'off'}"] = bench(s, timer, args, profiler, sim)
            print(f"\n{args.workload} with a modeled device, medians (ms; tree: both rounds)")
            print(f"{'prefills':>9} {'host':>8} {'wall':>8} {'device':>8} {'idle':>8} {'busy':>6}")
            for key in ("pipeline_off", "pipeline_on"):
                d = res[key]["device_summary"] = device_summary(res[key])
                print(
                    f"{key[9:]:>9} {d['host']:>8.1f} {d['sim_wall']:>8.1f} {d['sim_device']:>8.1f} "
                    f"{d['sim_idle']:>8.1f} {100 * d['sim_device'] / d['sim_wall']:>5.1f}%"
                )
        else:
            res = bench(s, timer, args, profiler, sim)
        timer.restore()
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    if profiler is not None:
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(args.profile)
        print(stream.getvalue())
        res["profile"] = stream.getvalue()
    name = "bench_admission" if args.workload == "fewshot" else "bench_admission_tree"
    if args.compare_pipeline:
        name += "_pipeline"
    save(f"{name}{args.tag}", res)


if __name__ == "__main__":
    main()
