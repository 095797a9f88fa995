"""An Engine's start: the checks made before any process starts (the model folder, the device, a model that
splits over the ranks asked for), then the scheduler process, launched while the Engine's own tokenizer
loads beside it, and its report that it is ready.

NOTE: the checks come first because a scheduler process that starts only to fail on them printed its
traceback and a "did not exit; terminating it" line before the error that matters.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..executor.model_files import load_tokenizer
from ..io_struct import SchedulerInfo
from ..server_args import ServerArgs
from .loop import in_background, result_interruptibly, stop_scheduler_process

STARTUP_TIMEOUT_S = 900


def checked_model_path(server_args: ServerArgs, model_path: Optional[str]) -> str:
    """The folder the scheduler will load (the embedded default model for None), checked, with the device
    and the split over ranks."""
    from ..models.default_model import resolve_model_path

    if model_path is None:
        path = resolve_model_path(None)
    else:
        path = server_args.model_path  # "~" expanded
        from ..executor.model_files import check_is_folder
        from ..models.config import BUILTIN_SHAPES

        if not (server_args.load_format == "dummy" and path in BUILTIN_SHAPES):
            check_is_folder(path)
    _check_device(server_args.device)
    if server_args.world_size() > 1:  # a model that cannot split
        from ..executor.model_files import check_model_splits

        check_model_splits(path, server_args)
    return path


@dataclass
class StartedScheduler:
    """A scheduler process that reported ready, the addresses the tokenizer manager talks to it on, and
    the tokenizer requests are encoded with."""

    proc: subprocess.Popen
    info: SchedulerInfo
    tokenizer: Any
    tmpdir: str  # its sockets' folder (removed when the process is stopped)
    to_scheduler: str
    from_scheduler: str
    launched: float  # time.time() at its launch (SchedulerInfo.startup_marks are times too)


def start_scheduler(server_args: ServerArgs, model_path: str) -> StartedScheduler:
    """Launch the scheduler process and wait until it is ready; a failed start leaves no process behind."""
    tmpdir = tempfile.mkdtemp(prefix="plait-")
    to_sched = f"ipc://{tmpdir}/to_scheduler"
    from_sched = f"ipc://{tmpdir}/from_scheduler"
    ready_addr = f"ipc://{tmpdir}/ready"
    launched = time.time()
    proc = launch_scheduler(server_args, model_path, to_sched, from_sched, ready_addr, tmpdir)
    # NOTE: loaded while the scheduler process starts (it loads the model and its own tokenizer): one after
    # the other, the two took a third of a CPU start-up.
    tokenizer = in_background(load_tokenizer, server_args.tokenizer_path or model_path)
    reported = False
    try:
        status, payload = wait_scheduler_ready(proc, ready_addr)
        if status != "ready":
            reported = True
            raise RuntimeError(f"the scheduler failed to start: {payload}")
        return StartedScheduler(proc, payload, result_interruptibly(tokenizer), tmpdir, to_sched, from_sched, launched)
    except BaseException:  # (Ctrl-C while loading included) no scheduler process may outlive a failed start
        # NOTE: one that reported its error exits by itself: terminating it at once only added a
        # misleading "did not exit; terminating it" warning after its traceback.
        stop_scheduler_process(proc, tmpdir, patience_s=5 if reported else 0)
        raise


def launch_scheduler(
    server_args, model_path: str, to_sched: str, from_sched: str, ready_addr: str, tmpdir: str
) -> subprocess.Popen:
    """Start the scheduler process; it reports on `ready_addr` (see `wait_scheduler_ready`).

    NOTE: a fresh interpreter (`python -m plait.runtime.scheduler`), not a multiprocessing child:
    spawn would re-import the user's __main__, which breaks scripts that create an Engine at top level
    without an `if __name__ == "__main__"` guard."""
    spec = os.path.join(tmpdir, "scheduler_args.pkl")
    with open(spec, "wb") as f:
        pickle.dump((server_args, model_path, to_sched, from_sched, ready_addr), f)
    # dp_size > 1: the data-parallel controller takes the scheduler's place (same arguments, same messages)
    # and starts the replicas' schedulers (runtime/distributed/data_parallel.py).
    module = "plait.runtime.distributed.data_parallel" if server_args.dp_size > 1 else "plait.runtime.scheduler"
    return subprocess.Popen([sys.executable, "-m", module, spec], close_fds=True)


def wait_scheduler_ready(proc: subprocess.Popen, ready_addr: str) -> tuple:
    """("ready", SchedulerInfo) or ("error", why)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(ready_addr)
    try:
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            if sock.poll(500):
                return sock.recv_pyobj()
            waited += 0.5
            if proc.poll() is not None:
                return ("error", f"scheduler process exited with code {proc.returncode}")
        return ("error", "timed out waiting for the scheduler")
    finally:
        sock.close(linger=0)
        ctx.term()


def _check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():  # (the scheduler failed on it with an AttributeError deep in torch)
            raise ValueError("device='cuda' but torch sees no CUDA device here; use device='auto' or 'cpu'")
