"""A modeled GPU behind a CPU scheduler's model runner (bench_admission.py --sim-device): launched steps
occupy it by a cost model, reading a step back waits for its end, so a CPU run shows how much host work
overlap scheduling hides."""

from __future__ import annotations

import time

from bench_host_overhead import DeviceTimer


class SimulatedDevice:
    """A modeled GPU behind the model runner of a CPU scheduler: a step occupies the device from its
    launch (or when the step before it ends) for `cost(batch)` seconds; `resolve` (and `run`, which
    reads back at once) waits until the step's end. Times are on a clock that leaves out the stubbed
    forward's CPU time (`DeviceTimer.timed`), which a GPU host does not spend."""

    def __init__(
        self,
        model_runner,
        device_timer: DeviceTimer,
        prefill_us_per_token: float,
        step_ms: float,
        decode_us_per_row: float,
    ):
        self.prefill_s_per_token = prefill_us_per_token * 1e-6
        self.step_s = step_ms * 1e-3
        self.decode_s_per_row = decode_us_per_row * 1e-6
        self.busy = 0.0  # device seconds since the last `take`
        self.waited = {"resolve": 0.0, "run": 0.0}  # host seconds spent waiting for it, since `take`
        self._free_at = 0.0
        self._stub = 0.0  # CPU seconds spent in stubbed device work, left off the clock
        self._ends: dict = {}  # id(handle) -> (handle, end of its step)
        timed = device_timer.timed

        def timed_off_the_clock(fn, *a, **k):
            t = time.perf_counter()
            try:
                return timed(fn, *a, **k)
            finally:
                self._stub += time.perf_counter() - t

        device_timer.timed = timed_off_the_clock
        mr = model_runner
        run, launch, resolve = mr.run, mr.launch, mr.resolve

        def sim_run(step):
            end = self._occupy(step)
            out = run(step)
            self._wait(end, "run")
            return out

        def sim_launch(step, *a, **k):
            end = self._occupy(step)
            handle = launch(step, *a, **k)
            self._ends[id(handle)] = (handle, end)
            return handle

        def sim_resolve(handle):
            self._wait(self._ends.pop(id(handle))[1], "resolve")
            return resolve(handle)

        # NOTE: instance attributes shadow the methods; the scheduler calls these.
        mr.run, mr.resolve = sim_run, sim_resolve
        mr.launch = sim_launch

    def cost(self, step) -> float:
        if step.mode.is_extend():
            return self.step_s + self.prefill_s_per_token * sum(step.extend_lens)
        return self.step_s + self.decode_s_per_row * step.batch_size

    def now(self) -> float:
        return time.perf_counter() - self._stub

    def _occupy(self, step) -> float:
        start = max(self.now(), self._free_at)
        dur = self.cost(step)
        self._free_at = start + dur
        self.busy += dur
        return self._free_at

    def _wait(self, end: float, where: str) -> None:
        t = time.perf_counter()
        left = end - self.now()
        if left > 0:
            time.sleep(left)
        self.waited[where] += time.perf_counter() - t

    def take(self) -> tuple[float, dict]:
        """(device busy seconds, host seconds waiting for it in resolve / run) since the last take."""
        busy, waited = self.busy, self.waited
        self.busy, self.waited = 0.0, {"resolve": 0.0, "run": 0.0}
        return busy, waited
