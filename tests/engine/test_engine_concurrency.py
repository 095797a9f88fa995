"""The Engine embedded in an application that uses it carelessly: many threads and asyncio tasks at once,
streams abandoned or broken by their consumer, aborts from another thread, shutdown with requests in
flight, engines dropped without shutdown, Ctrl-C during a blocking generate.

The default model, outputs of a few tokens. One engine serves the module; the lifecycle tests start
their own (a few seconds each).
"""

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
from plait.runtime import Engine

SHORT = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
# Minutes on the CPU: only an abort or a shutdown ends it within a test.
ENDLESS = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}
ENGINE_ARGS = dict(num_threads=1, max_total_tokens=4096)


@pytest.fixture(scope="module")
def eng():
    with Engine(**ENGINE_ARGS) as e:
        yield e


def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def assert_idle(eng) -> None:
    """Nothing left anywhere: the scheduler holds no request (aborts travel asynchronously), the
    tokenizer manager no state, and every KV slot is accounted for."""

    def idle():
        stats = eng.get_stats()
        return stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0

    wait_until(idle, "the scheduler is idle")
    assert not eng.tokenizer_manager.states
    assert eng.check_integrity()


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


# ---------------------------------------------------------------------- concurrency
def test_threads_and_asyncio_tasks_at_once(eng):
    results, errors = {}, []

    def sync_caller(i):
        try:
            results[f"t{i}"] = eng.generate(f"Thread {i} says", SHORT)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    def async_callers():
        async def run():
            return await asyncio.gather(*[eng.async_generate(f"Task {i} says", SHORT) for i in range(8)])

        for i, out in enumerate(asyncio.run(run())):
            results[f"a{i}"] = out

    threads = [threading.Thread(target=sync_caller, args=(i,)) for i in range(8)]
    threads.append(threading.Thread(target=async_callers))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 16
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 3} for o in results.values())
    assert len({o["meta_info"]["id"] for o in results.values()}) == 16
    assert_idle(eng)


def test_batch_of_200_prompts_keeps_order(eng):
    prompts = [f"Item {i}:" for i in range(200)]
    outs = eng.generate(prompts, {"temperature": 0, "max_new_tokens": 1})
    assert len(outs) == 200
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(eng.tokenizer_manager.tokenize(p)) for p in prompts]
    assert outs[7]["output_ids"] == eng.generate(prompts[7], {"temperature": 0, "max_new_tokens": 1})["output_ids"]
    assert_idle(eng)


def test_abort_from_another_thread_ends_a_blocking_generate(eng):
    result = {}
    caller = threading.Thread(target=lambda: result.update(out=eng.generate("Write a poem", ENDLESS, rid="victim")))
    caller.start()
    wait_until(lambda: eng.get_stats()["num_running_reqs"] == 1, "the request runs")
    eng.abort("victim")
    caller.join(timeout=60)
    assert not caller.is_alive()
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle(eng)


@pytest.mark.parametrize("how", ["break", "raise"])
def test_a_stream_left_half_way_is_aborted(eng, how):
    def consume():
        for _ in eng.generate("Tell me a story", ENDLESS, stream=True):
            if how == "raise":
                raise KeyError("the consumer failed")
            break  # the generator is dropped here and collected

    if how == "raise":
        with pytest.raises(KeyError):
            consume()
    else:
        consume()
    gc.collect()
    assert_idle(eng)


def test_an_async_stream_whose_loop_closes_unread_is_aborted(eng, caplog):
    # A consumer that reads one chunk and closes its event loop without closing the stream (no
    # shutdown_asyncgens, as a hand-run loop or a crashed framework does): the engine can no longer
    # deliver anything, so the request must stop, and quietly.
    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(eng.async_generate("Tell me a story", ENDLESS, stream=True))
    loop.run_until_complete(stream.__anext__())
    loop.close()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert_idle(eng)
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    del stream


def test_streams_read_on_the_engines_own_loop(eng):
    # What plait serve's routes do (Engine.run_on_loop): the stream is the tokenizer manager's own, with
    # no thread between; one read to the end, one left after its first chunk (aborted: nothing left).
    async def on_loop():
        whole = [c async for c in await eng.async_stream_deltas("Count to ten:", SHORT)]
        stream = await eng.async_stream_deltas("Tell me a story", ENDLESS)
        first = await stream.__anext__()
        await stream.aclose()
        return whole, first

    whole, first = eng.run_on_loop(on_loop())
    assert sum(len(c["output_ids"]) for c in whole) == 3
    assert whole[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert first["meta_info"]["finish_reason"] is None
    assert_idle(eng)


def test_a_blocking_call_from_the_engines_own_loop_is_an_error_not_a_hang(eng):
    async def on_loop():
        with pytest.raises(RuntimeError, match="would wait for itself"):
            eng.get_stats()
        return "served"

    assert eng.run_on_loop(on_loop()) == "served"
    assert_idle(eng)


def test_an_async_stream_consumer_that_raises_leaves_no_task_error(eng, caplog):
    async def consume():
        async for _ in await eng.async_generate("Tell me a story", ENDLESS, stream=True):
            # Hold the engine's loop while asyncio.run closes this one: the stream's cancellation then
            # reaches the engine after the consumer's loop is gone (the order a busy machine gives).
            eng._bg.loop.call_soon_threadsafe(time.sleep, 0.3)
            raise KeyError("the consumer failed")

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(KeyError):
            asyncio.run(consume())
        assert_idle(eng)
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_bad_item_refuses_the_whole_batch(eng):
    # As SGLang: one invalid item and nothing of the batch runs.
    before = eng.get_stats()["num_finished"]
    with pytest.raises(ValueError, match="batch item 1: .*temperature"):
        eng.generate(["a", "b", "c"], [SHORT, {**SHORT, "temperature": -1}, SHORT])
    with pytest.raises(ValueError, match="batch item 1: input_ids must be ints in"):
        eng.generate(input_ids=[[1, 2], [1, 10**9], [3]], sampling_params=SHORT)
    assert eng.get_stats()["num_finished"] == before
    assert_idle(eng)


# ---------------------------------------------------------------------- lifecycle
def test_shutdown_with_requests_in_flight_fails_them_and_the_scheduler_exits():
    eng = Engine(**ENGINE_ARGS)
    outcomes = {}

    def record(name, fn):
        try:
            outcomes[name] = fn()
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outcomes[name] = e

    async def awaited():
        return await eng.async_generate("Write a poem", ENDLESS)

    callers = [
        threading.Thread(target=record, args=(name, fn))
        for name, fn in [
            ("sync", lambda: eng.generate("Write a poem", ENDLESS)),
            ("stream", lambda: list(eng.generate("Write a poem", ENDLESS, stream=True))),
            ("async", lambda: asyncio.run(awaited())),
        ]
    ]
    for t in callers:
        t.start()
    wait_until(lambda: eng.get_stats()["num_running_reqs"] == 3, "the three requests run")
    eng.shutdown()
    for t in callers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in callers), "a caller still hangs after shutdown"
    for name in ("sync", "stream", "async"):
        assert isinstance(outcomes[name], RuntimeError), (name, outcomes[name])
        assert "shut down" in str(outcomes[name])
    assert eng._proc.returncode == 0  # it exited by itself, not terminated after the engine's patience ran out

    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("Hello", SHORT)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("Hello", SHORT, stream=True)
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(eng.async_generate("Hello", SHORT))
    with pytest.raises(RuntimeError, match="shut down"):
        eng.get_stats()
    eng.abort("anything")  # nothing to abort: no error
    eng.shutdown()  # twice: no error


def test_a_dropped_engine_is_released():
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()
    eng = Engine(**ENGINE_ARGS)
    eng.generate("Hello", SHORT)
    pid, ref = eng._proc.pid, weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None
    wait_until(lambda: process_gone(pid), "the scheduler process exits", timeout_s=30)
    assert threading.active_count() == threads_before
    assert len(os.listdir("/proc/self/fd")) <= fds_before


# NOTE: each script first gives SIGINT Python's own handler: a test run launched in the background (`pytest &`)
# hands its children SIGINT ignored, and a Ctrl-C that is ignored tests nothing.
CTRL_C_SCRIPT = textwrap.dedent("""
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from plait.runtime import Engine
    eng = Engine(num_threads=1, max_total_tokens=4096)
    print(eng._proc.pid, flush=True)
    eng.generate("Write a poem", {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True})
""")


def test_ctrl_c_during_a_blocking_generate_exits_cleanly(tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    # A session of its own: Ctrl-C in a terminal signals the whole process group, the scheduler included.
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        scheduler_pid = int(proc.stdout.readline())
        time.sleep(1.0)  # inside the blocking generate
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGINT  # KeyboardInterrupt, uncaught
    assert stderr.count("KeyboardInterrupt") == 1, stderr  # the caller's traceback only, not the scheduler's
    wait_until(lambda: process_gone(scheduler_pid), "the scheduler process exits", timeout_s=10)


LATCHED_CTRL_C_SCRIPT = textwrap.dedent("""
    import signal, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from plait.runtime import Engine
    eng = Engine(num_threads=1, max_total_tokens=4096)

    def latch_sigint():
        time.sleep(1.0)
        # SIGINT handled on this thread: Python's flag is set, but the main thread's wait is not interrupted, as
        # when Ctrl-C lands on a loaded machine just before the main thread goes to sleep.
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    for stream in (False, True):
        latch = threading.Thread(target=latch_sigint, daemon=True)
        latch.start()
        try:
            out = eng.generate("Write a poem", {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True},
                               stream=stream)
            if stream:
                out = list(out)[-1]
            print("finished", out["meta_info"]["completion_tokens"], flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        latch.join()
    eng.shutdown()
""")


def test_ctrl_c_latched_before_a_blocking_wait_still_ends_it(tmp_path):
    # A blocking generate waited on a lock with no timeout: a SIGINT whose handler ran just before (or on another
    # thread than) that sleep woke nothing, and the KeyboardInterrupt came when the 2,000 tokens were done, a
    # minute or more later on a loaded machine. A streamed generate waited on its queue the same way.
    script = tmp_path / "latched_ctrl_c.py"
    script.write_text(LATCHED_CTRL_C_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["interrupted", "interrupted"], done.stdout


def test_ttft_of_a_request_not_streamed_is_its_first_token_not_its_end(eng):
    # A request that is not streamed gets its ids in one message at the end; ttft used to be taken when that
    # message arrived, so it equalled e2e_latency. It is now the scheduler's time of the first token.
    out = eng.generate("Count from one to twenty:", {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 24
    assert 0 < meta["ttft"] < meta["e2e_latency"] / 2, meta
    streamed = list(
        eng.generate(
            "Count from one to twenty:", {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}, stream=True
        )
    )[-1]["meta_info"]
    assert 0 < streamed["ttft"] < streamed["e2e_latency"] / 2, streamed
