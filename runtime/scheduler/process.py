"""The scheduler process: its entry point (`python -m plait.runtime.scheduler ARGS.pkl`) and its
event loop over ZMQ (receive messages, step the Scheduler, send outputs; block only when idle).

The Engine writes (server_args, model_path, addresses) to a pickle file in its private temp folder
and starts this module in a fresh interpreter.
"""

import gc
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Optional

import torch
import zmq

from ..io_struct import BatchOut, ShutdownReq
from ..server_args import ServerArgs
from .scheduler import Scheduler, create_scheduler

logger = logging.getLogger("plait.scheduler")


def main() -> None:
    imported = time.time()  # (this module's imports, torch's among them, are most of a CPU start-up)
    with open(sys.argv[1], "rb") as f:
        server_args, model_path, to_sched, from_sched, ready_addr = pickle.load(f)
    # NOTE: Ctrl-C in a terminal signals the whole process group, this child included. Its life belongs
    # to the engine (a ShutdownReq, or the parent's exit below): a KeyboardInterrupt here would only
    # print a second traceback and leave the engine's in-flight requests to the watchdog.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The scheduler must not outlive its engine: exit when the parent process goes away.
    parent = os.getppid()
    import threading

    def watch_parent():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    run_scheduler_process(server_args, model_path, to_sched, from_sched, ready_addr, {"imported": imported})


def run_scheduler_process(
    server_args: ServerArgs,
    model_path: str,
    in_addr: str,
    out_addr: str,
    ready_addr: str,
    startup_marks: Optional[dict] = None,
) -> None:
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if server_args.num_threads:
        torch.set_num_threads(server_args.num_threads)
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PUSH)
    ready.connect(ready_addr)
    try:
        scheduler = create_scheduler(server_args, model_path, startup_marks)
    except Exception as e:
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready.send_pyobj(("error", f"{type(e).__name__}: {e}"))
        ready.close(linger=2000)
        return
    freeze_startup_heap()
    recv = ctx.socket(zmq.PULL)
    recv.bind(in_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(out_addr)
    scheduler.startup_marks["ready"] = time.time()
    ready.send_pyobj(("ready", scheduler.info()))
    ready.close(linger=2000)
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    try:
        _serve_maybe_profiled(scheduler, poller, recv, send)
    finally:
        # NOTE: linger 0: outputs still queued for an engine that has gone can never be delivered, and
        # the default (wait forever) would hang this process's exit on them.
        recv.close(linger=0)
        send.close(linger=0)
        if scheduler.kv_events is not None:
            scheduler.kv_events.close()
        ctx.term()


def _serve_maybe_profiled(scheduler: Scheduler, poller, recv, send) -> None:
    profile_path = os.environ.get("PLAIT_SCHEDULER_PROFILE")
    if profile_path:  # diagnosing host time on a device machine: cProfile of the whole loop, dumped at shutdown
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            _serve(scheduler, poller, recv, send)
        finally:
            profiler.disable()
            profiler.dump_stats(profile_path)
        return
    trace_path = os.environ.get("PLAIT_SCHEDULER_TRACE")
    if trace_path:  # diagnosing device time: every CUDA kernel and copy of the run, as a Chrome trace at shutdown
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            try:
                _serve(scheduler, poller, recv, send)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
        prof.export_chrome_trace(trace_path)
        return
    _serve(scheduler, poller, recv, send)


def _serve(scheduler: Scheduler, poller, recv, send) -> None:
    """The loop: receive messages, step, send outputs; returns at shutdown."""
    checked_idle = True
    while True:
        idle = scheduler.is_idle()
        if idle and not checked_idle:
            scheduler.check_integrity(full=False)  # the slot count only: O(1), unlike the tree walk
            checked_idle = True
        # Block only when there is nothing to do (grammar compiles are polled every 5 ms).
        timeout = None if idle else 0
        if scheduler.queues.grammar_pending and not scheduler.queues.running and not scheduler.queues.waiting:
            timeout = 5
        events = dict(poller.poll(timeout))
        t_in = time.perf_counter()
        while events.get(recv):
            msg = recv.recv_pyobj()
            if isinstance(msg, ShutdownReq):
                return
            reply = scheduler.handle_message(msg)
            if reply is not None:
                send.send_pyobj(reply)
            events = dict(poller.poll(0))
        scheduler.timer.phase("intake", time.perf_counter() - t_in)
        try:
            batch = scheduler.step()
        except Exception:
            logger.error("step failed:\n%s", traceback.format_exc())
            scheduler.fail_all(traceback.format_exc().splitlines()[-1])
            batch = None
        if batch is not None:
            checked_idle = False
        t_out = time.perf_counter()
        outs = scheduler.collect_outputs()
        if outs:
            send.send_pyobj(BatchOut(outs))
        if scheduler.kv_events is not None:  # what this step (or a flush) did to the cache
            scheduler.kv_events.publish()
        scheduler.timer.phase("outputs", time.perf_counter() - t_out)


def freeze_startup_heap() -> None:
    """Move everything allocated so far (torch, transformers, the model) out of the GC's reach, and make
    young collections rarer.

    NOTE: the interpreter holds a few hundred thousand long-lived objects after start-up; every full
    collection walks them all. The per-step garbage of a large decode batch triggers collections
    often enough that, unfrozen, they cost several ms per step at batch 512. Frozen objects are
    never collected, which is right for what lives as long as the process.
    """
    gc.collect()
    gc.freeze()
    # NOTE: and collect the young generation after 20,000 new container objects instead of 700. A round
    # of 256 requests with 2,050-token prompts allocates thousands of lists, and each young collection
    # walks every id of every prompt list still young: a sixth of a fewshot round's host work on the CPU
    # (benchmarks/scheduler/bench_admission.py; RESULTS.md), none with these thresholds. Cycles are
    # still collected, later.
    gc.set_threshold(20000, 50, 100)


if __name__ == "__main__":
    main()
