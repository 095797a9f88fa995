"""Starting a model's ranks and noticing when one dies.

Each rank is its own process (`python -m plait.runtime.distributed SPEC`, with torchrun's environment:
topology.py). On node 0 the scheduler process is rank 0 and starts the node's other ranks as its
children; on another node (`plait serve --node-rank N`) a launcher starts that node's ranks and waits.

A split model cannot go on without any of its ranks (the others would wait at their next collective
forever), so a rank that dies ends the group: the `GroupMonitor` on rank 0 sees a child exit (or a
remote rank's heartbeat stop), terminates the other ranks and ends the scheduler process; the engine
then answers 503, as for any scheduler that died. The `RankWatchdog` in every other rank ends it when
rank 0 is gone (its parent process changed, or rank 0's store stopped answering). Nothing is left
running: no rank waits at a collective for a peer that is gone.
"""

from __future__ import annotations

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
from datetime import timedelta
from typing import Callable, Optional

from ..server_args import ServerArgs
from .topology import Rendezvous, Topology

logger = logging.getLogger("plait.distributed")

POLL_S = 0.5  # how often the monitor looks at the ranks
HEARTBEAT_S = 1.0  # how often a rank says it is alive (in rank 0's store)
HEARTBEAT_TIMEOUT_S = 30.0  # a remote rank silent this long is taken for dead
STOP_WAIT_S = 10.0  # how long a stopped group's ranks get to exit before they are killed


class LocalRanks:
    """This node's rank processes that this process started: (rank, process) each."""

    def __init__(
        self, server_args: ServerArgs, model_path: str, topology: Topology, rendezvous: Rendezvous, ranks: list[int]
    ):
        self.folder = tempfile.mkdtemp(prefix="plait-ranks-")
        spec = os.path.join(self.folder, "rank_args.pkl")
        with open(spec, "wb") as f:
            pickle.dump((server_args, model_path), f)
        self.procs: list[tuple[int, subprocess.Popen]] = []
        for rank in ranks:
            env = {**os.environ, **rendezvous.rank_env(topology, rank)}
            self.procs.append(
                (
                    rank,
                    subprocess.Popen(
                        [sys.executable, "-m", "plait.runtime.distributed", spec], env=env, close_fds=True
                    ),
                )
            )

    def exited(self) -> Optional[tuple[int, subprocess.Popen]]:
        """The first rank whose process has exited, if any."""
        return next(((rank, p) for rank, p in self.procs if p.poll() is not None), None)

    def stop(self, patience_s: float, terminate: bool = False) -> None:
        """Wait up to `patience_s` for the ranks to exit (after SIGTERM with `terminate`), then kill the rest."""
        reap([p for _, p in self.procs], patience_s, terminate)
        shutil.rmtree(self.folder, ignore_errors=True)


def reap(procs: list[subprocess.Popen], patience_s: float, terminate: bool = False) -> None:
    """Wait up to `patience_s` for `procs` to exit (after SIGTERM with `terminate`), then SIGTERM what is
    left and, 5 s later, SIGKILL."""
    if terminate:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + patience_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("process %d did not exit; killing it", proc.pid)
            proc.kill()
            proc.wait()


def _store_client(rendezvous: Rendezvous, world_size: int):
    import torch.distributed as dist

    # NOTE: a connection of the thread's own (the rank's main store may be inside a blocking call).
    return dist.TCPStore(rendezvous.host, rendezvous.port, world_size, is_master=False, timeout=timedelta(seconds=10))


class PeriodicCheck:
    """`check()` every `interval_s` on a daemon thread, until `stop()` or until it returns False."""

    def __init__(self, name: str, interval_s: float, check: Callable[[], bool]):
        self._check = check
        self._interval = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval) and self._check():
            pass


class GroupMonitor:
    """Rank 0's watch over the other ranks: its child processes, and the heartbeats of ranks on other
    nodes. `on_failure(message)` is called once, from the monitor's thread, when one is gone; `stop()`
    when the group is shut down on purpose (ranks exiting then are no failure)."""

    def __init__(
        self, children: LocalRanks, topology: Topology, rendezvous: Rendezvous, on_failure: Callable[[str], None]
    ):
        self.children = children
        self.topology = topology
        self.rendezvous = rendezvous
        self.on_failure = on_failure
        local = {rank for rank, _ in children.procs} | {0}
        self.remote = [r for r in range(topology.world_size) if r not in local]
        self.started = time.monotonic()
        self._store = None
        self._watch = PeriodicCheck("plait-rank-monitor", POLL_S, self._check)

    def start(self) -> None:
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()

    def _check(self) -> bool:
        gone = self.children.exited()
        if gone is not None and not self._watch.stopping:
            rank, proc = gone
            self.on_failure(
                f"rank {rank} of {self.topology.world_size} (pid {proc.pid}) exited with code {proc.returncode}"
            )
            return False
        if self.remote and time.monotonic() - self.started > HEARTBEAT_TIMEOUT_S:
            try:
                self._store = self._store or _store_client(self.rendezvous, self.topology.world_size)
                silent = [r for r in self.remote if time.time() - _last_beat(self._store, r) > HEARTBEAT_TIMEOUT_S]
            except Exception as e:  # noqa: BLE001 - the store is this process's own: it cannot be gone
                logger.warning("rank monitor could not read the heartbeats: %s", e)
                return True
            if silent and not self._watch.stopping:
                self.on_failure(f"rank(s) {silent} on another node sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f} s")
                return False
        return True


def _last_beat(store, rank: int) -> float:
    key = f"plait/alive/{rank}"
    return float(store.get(key)) if store.check([key]) else 0.0


class RankWatchdog:
    """A non-zero rank's watch over rank 0: exits the process when its parent went away (the scheduler
    process on node 0, the node's launcher elsewhere) or rank 0's store stopped answering; and sends
    this rank's heartbeats. `stop()` once the group stops on purpose (a STOP plan)."""

    def __init__(self, rank: int, topology: Topology, rendezvous: Rendezvous):
        self.rank = rank
        self.topology = topology
        self.rendezvous = rendezvous
        self.parent = os.getppid()
        self._store = None
        self._watch = PeriodicCheck("plait-rank-watchdog", HEARTBEAT_S, self._check)

    def start(self) -> None:
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()

    def _check(self) -> bool:
        if os.getppid() != self.parent:
            logger.error("rank %d: its parent process is gone; exiting", self.rank)
            os._exit(1)
        try:
            self._store = self._store or _store_client(self.rendezvous, self.topology.world_size)
            self._store.set(f"plait/alive/{self.rank}", repr(time.time()))
        except Exception as e:  # noqa: BLE001 - rank 0 (which holds the store) is gone
            if self._store is not None and not self._watch.stopping:
                logger.error("rank %d: rank 0 stopped answering (%s); exiting", self.rank, e)
                os._exit(1)
        return True


def exit_group(message: str, children: LocalRanks) -> None:
    """End rank 0's process after a rank failed: the others terminated, then exit at once (the main
    thread may be inside a collective that will never complete)."""
    logger.error("the model's ranks cannot go on: %s; ending them", message)
    children.stop(5.0, terminate=True)
    os._exit(1)


def serve_node(server_args: ServerArgs, model_path: Optional[str]) -> int:
    """A node other than 0 (`plait serve --node-rank N`): start this node's ranks and wait for them; the
    exit code of the first that fails, else 0. SIGTERM / SIGINT stop them."""
    from ..models.default_model import resolve_model_path

    model_path = resolve_model_path(model_path)
    topology = Topology.of(server_args)
    rendezvous = Rendezvous.of(server_args)
    ranks = LocalRanks(server_args, model_path, topology, rendezvous, list(topology.node_ranks()))
    logger.info(
        "node %d: ranks %s started, rendezvous at %s:%d",
        topology.node_rank,
        list(topology.node_ranks()),
        rendezvous.host,
        rendezvous.port,
    )
    stopping = threading.Event()

    def stop(*_):
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping.wait(POLL_S):
        gone = ranks.exited()
        if gone is not None:  # one rank ended (a stopped group, or a failure): the others cannot go on
            code = gone[1].returncode
            break
    ranks.stop(STOP_WAIT_S, terminate=True)
    return code
