"""Data parallelism (`dp_size` N): N replicas of the model on this machine, each its own scheduler process
with its own KV cache, behind one engine.

The engine starts this controller where it would start its scheduler (`python -m
plait.runtime.distributed.data_parallel ARGS.pkl`, the same arguments and the same ZMQ messages), and
the controller starts the N schedulers (replica i on GPUs from base_gpu_id + i x tp_size x pp_size).
Each request goes to one replica, chosen as the router chooses (router/policy.py over the prompt's
token ids in its LoRA adapter's and cache salt's namespace: where its prefix is likely cached while the
replicas' loads are close, else the least loaded); its aborts follow it. Control calls go to every
replica and their replies are merged (stats summed, flush and integrity true only when true everywhere,
one pin id for the pins on every replica, one replica's facts of a loaded adapter).
Outputs come back through the controller.

A replica that dies ends the controller, and with it the others: the engine then answers 503 for
everything, as for one scheduler that died (replicas that must outlive each other go behind
`plait router`, each its own server).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import zmq

from ..io_struct import (
    AbortReq,
    BatchOut,
    ControlReply,
    ControlReq,
    LoadLoraAdapterReq,
    PinPrefixReq,
    SchedulerInfo,
    ShutdownReq,
    TokenizedGenerateReq,
    UnpinPrefixReq,
)
from ..request_options import cache_key_prompt
from ..router.policy import CacheAwarePolicy
from ..server_args import ServerArgs
from .launch import reap
from .topology import replica_endpoint

logger = logging.getLogger("plait.data_parallel")

STARTUP_TIMEOUT_S = 900
MEAN_STATS = ("token_usage", "avg_spec_accept_length", "hicache_host_usage")


def replica_args(server_args: ServerArgs, i: int) -> ServerArgs:
    """Replica i's settings: one replica (dp_size 1), on its own GPUs, publishing its KV events on its own port."""
    return dataclasses.replace(
        server_args,
        dp_size=1,
        dist_init_addr=None,
        base_gpu_id=server_args.base_gpu_id + i * server_args.world_size(),
        kv_events_endpoint=replica_endpoint(server_args.kv_events_endpoint, i),
    )


def merge_info(infos: list[SchedulerInfo]) -> SchedulerInfo:
    """What the tokenizer manager validates against: a request must fit one replica (the smallest pool),
    and as many may run as all replicas together run."""
    first = infos[0]
    return dataclasses.replace(
        first,
        max_total_tokens=min(i.max_total_tokens for i in infos),
        max_running_requests=sum(i.max_running_requests for i in infos),
    )


def merge_stats(replies: list[dict]) -> dict:
    """The replicas' get_stats() as one: counters summed (nested ones too), shares averaged, the cache
    hit rate recomputed; each replica's own under "dp_replicas"."""

    def merge(values: list):
        head = values[0]
        if isinstance(head, bool) or head is None or isinstance(head, str):
            return next((v for v in values if v), head)
        if isinstance(head, (int, float)):
            return sum(values)
        if isinstance(head, dict):
            return {k: merge([v.get(k, head[k]) for v in values]) for k in head}
        return head

    out = merge(replies)
    for key in MEAN_STATS:
        if key in out:
            out[key] = sum(r[key] for r in replies) / len(replies)
    if "prompt_tokens" in out:
        out["cache_hit_rate"] = out.get("cached_tokens", 0) / max(1, out["prompt_tokens"])
    out["dp_replicas"] = replies
    return out


class DataParallelController:
    def __init__(self, server_args: ServerArgs, model_path: str):
        self.server_args = server_args
        self.n = server_args.dp_size
        self.policy = CacheAwarePolicy()
        self.names = [f"replica{i}" for i in range(self.n)]
        self.open: dict[str, int] = {}  # rid -> replica of requests not finished
        self.load = [0] * self.n
        self.pending_calls: dict[int, tuple[ControlReq, list[Optional[ControlReply]]]] = {}
        self.pins: dict[int, list[Optional[int]]] = {}  # controller pin id -> each replica's
        self._pin_ids = itertools.count(1)
        self.folder = tempfile.mkdtemp(prefix="plait-dp-")
        self.ctx = zmq.Context()
        self.procs: list[subprocess.Popen] = []
        self.to_replicas: list[Any] = []
        # One socket per replica's outputs: a control reply must be told apart by its replica (pin ids).
        self.from_replicas = [self.ctx.socket(zmq.PULL) for _ in range(self.n)]
        for i, sock in enumerate(self.from_replicas):
            sock.bind(f"ipc://{self.folder}/from{i}")
        try:
            self.infos = self._start_replicas(model_path)
        except BaseException:
            self.stop(patience_s=0)
            raise

    def _start_replicas(self, model_path: str) -> list[SchedulerInfo]:
        readies = []
        for i in range(self.n):
            spec = os.path.join(self.folder, f"replica{i}.pkl")
            ready = self.ctx.socket(zmq.PULL)
            ready.bind(f"ipc://{self.folder}/ready{i}")
            readies.append(ready)
            with open(spec, "wb") as f:
                pickle.dump(
                    (
                        replica_args(self.server_args, i),
                        model_path,
                        f"ipc://{self.folder}/to{i}",
                        f"ipc://{self.folder}/from{i}",
                        f"ipc://{self.folder}/ready{i}",
                    ),
                    f,
                )
            self.procs.append(subprocess.Popen([sys.executable, "-m", "plait.runtime.scheduler", spec], close_fds=True))
        infos = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for i, ready in enumerate(readies):
            while not ready.poll(500):
                if self.procs[i].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"data-parallel replica {i} failed to start (exit code {self.procs[i].poll()})")
            status, payload = ready.recv_pyobj()
            ready.close(linger=0)
            if status != "ready":
                raise RuntimeError(f"data-parallel replica {i}: {payload}")
            infos.append(payload)
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(f"ipc://{self.folder}/to{i}")
            self.to_replicas.append(sock)
        return infos

    # ------------------------------------------------------------------ from the engine
    def dispatch(self, msg: Any) -> Optional[ControlReply]:
        """One message from the tokenizer manager; a reply to send back at once, if any."""
        if isinstance(msg, TokenizedGenerateReq):
            # keyed as the replicas' prefix caches key it: a LoRA adapter's or a cache salt's prefixes are
            # their own, so affinity never sends a tenant where only another namespace's copy is cached
            opts = msg.options
            key = tuple(cache_key_prompt(msg.input_ids, opts.lora_path, opts.cache_salt))
            choice = self.policy.choose(key, self.names, dict(zip(self.names, self.load)))
            i = self.names.index(choice.replica)
            self.open[msg.rid] = i
            self.load[i] += 1
            self.to_replicas[i].send_pyobj(msg)
        elif isinstance(msg, AbortReq):
            i = self.open.get(msg.rid)
            for sock in self.to_replicas if i is None else [self.to_replicas[i]]:
                sock.send_pyobj(msg)  # (a replica ignores a rid it does not hold)
        elif isinstance(msg, ControlReq):
            return self._control(msg)
        return None

    def _control(self, msg: ControlReq) -> Optional[ControlReply]:
        per_replica = [msg] * self.n
        if isinstance(msg, UnpinPrefixReq):
            ids = self.pins.pop(msg.pin_id, None)
            if ids is None:
                return ControlReply(msg.call_id, result=False)
            per_replica = [dataclasses.replace(msg, pin_id=p if p is not None else -1) for p in ids]
        self.pending_calls[msg.call_id] = (msg, [None] * self.n)
        for sock, m in zip(self.to_replicas, per_replica):
            sock.send_pyobj(m)
        return None

    # ------------------------------------------------------------------ from the replicas
    def collect(self, replica: int, msg: Any) -> Optional[Any]:
        """One message from a replica; what to pass on to the engine, if anything yet."""
        if isinstance(msg, BatchOut):
            for o in msg.outputs:
                if o.finished_reason is not None and self.open.pop(o.rid, None) is not None:
                    self.load[replica] -= 1
            return msg
        if isinstance(msg, ControlReply):
            call, replies = self.pending_calls.get(msg.call_id, (None, None))
            if call is None:
                return None
            replies[replica] = msg
            if any(r is None for r in replies):
                return None
            del self.pending_calls[msg.call_id]
            return self._merge(call, replies)
        return None

    def _merge(self, call: ControlReq, replies: list[ControlReply]) -> ControlReply:
        errors = [r.error for r in replies if r.error]
        if errors:
            return ControlReply(call.call_id, error=errors[0])
        results = [r.result for r in replies]
        if isinstance(call, PinPrefixReq):
            pin_id = None
            if any(r["pin_id"] is not None for r in results):
                pin_id = next(self._pin_ids)
                self.pins[pin_id] = [r["pin_id"] for r in results]
            return ControlReply(
                call.call_id, result={"pin_id": pin_id, "pinned_tokens": max(r["pinned_tokens"] for r in results)}
            )
        if isinstance(call, LoadLoraAdapterReq):
            return ControlReply(call.call_id, result=results[0])  # the adapter's facts, alike on every replica
        if isinstance(results[0], dict):
            return ControlReply(call.call_id, result=merge_stats(results))
        if isinstance(results[0], bool):
            return ControlReply(call.call_id, result=all(results))
        return ControlReply(call.call_id, result=results[0])

    # ------------------------------------------------------------------ the loop
    def serve(self, in_addr: str, out_addr: str) -> None:
        """Relay until the engine's ShutdownReq (then the replicas are stopped), or a replica dies."""
        recv = self.ctx.socket(zmq.PULL)
        recv.bind(in_addr)
        send = self.ctx.socket(zmq.PUSH)
        send.connect(out_addr)
        poller = zmq.Poller()
        poller.register(recv, zmq.POLLIN)
        for sock in self.from_replicas:
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(1000))
                if recv in events:
                    msg = recv.recv_pyobj()
                    if isinstance(msg, ShutdownReq):
                        return
                    reply = self.dispatch(msg)
                    if reply is not None:
                        send.send_pyobj(reply)
                for i, sock in enumerate(self.from_replicas):
                    if sock in events:
                        out = self.collect(i, sock.recv_pyobj())
                        if out is not None:
                            send.send_pyobj(out)
                dead = next((i for i, p in enumerate(self.procs) if p.poll() is not None), None)
                if dead is not None:
                    logger.error(
                        "data-parallel replica %d (pid %d) exited with code %s; stopping the others",
                        dead,
                        self.procs[dead].pid,
                        self.procs[dead].returncode,
                    )
                    self.stop(patience_s=0)
                    os._exit(1)
        finally:
            recv.close(linger=0)
            send.close(linger=0)

    def stop(self, patience_s: float = 10.0) -> None:
        """Tell every replica to shut down, wait for them (then terminate), close their sockets."""
        for sock, proc in zip(self.to_replicas, self.procs):
            if proc.poll() is None:
                sock.send_pyobj(ShutdownReq())
        reap(self.procs, patience_s)
        for sock in [*self.to_replicas, *self.from_replicas]:
            sock.close(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        server_args, model_path, to_sched, from_sched, ready_addr = pickle.load(f)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (as the scheduler: the engine ends this process)
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    parent = os.getppid()

    def watch_parent():  # the controller, like a scheduler, must not outlive its engine
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PUSH)
    ready.connect(ready_addr)
    try:
        controller = DataParallelController(server_args, model_path)
    except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
        logger.exception("the data-parallel replicas failed to start")
        ready.send_pyobj(("error", f"{type(e).__name__}: {e}"))
        ready.close(linger=2000)
        return
    ready.send_pyobj(("ready", merge_info(controller.infos)))
    ready.close(linger=2000)
    try:
        controller.serve(to_sched, from_sched)
    finally:
        controller.stop()
        controller.ctx.term()
        ctx.term()


if __name__ == "__main__":
    main()
