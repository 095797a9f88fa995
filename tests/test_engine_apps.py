"""The Engine embedded in real applications: offline batch jobs, asyncio apps, worker processes.

A new user's trial of the Engine the way SGLang's / vLLM's offline engines are used; each test pins a
behaviour that was wrong before. One engine serves the module (default model, a few tokens per request).
"""

import atexit
import multiprocessing
import os
import time

import pytest

from plait.runtime import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def eng():
    with Engine(num_threads=1, max_total_tokens=4096) as e:
        yield e


def _generate_in_child(eng, q):
    started = time.monotonic()
    try:
        eng.generate("Hi", GREEDY)
        q.put(("no error", None))
    except Exception as e:  # noqa: BLE001 - sent back to the test
        q.put((repr(e), time.monotonic() - started))


def test_a_forked_child_gets_a_clear_error_and_leaves_the_parents_engine_alone(eng):
    # Before: the child's generate waited forever on the background loop thread that fork does not copy,
    # and a child exiting normally ran the engine's release (17 s, then it deleted the parent's sockets).
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_generate_in_child, args=(eng, q), daemon=True)
    child.start()
    try:
        error, waited = q.get(timeout=30)
    finally:
        child.kill()
        child.join(30)
    assert "forked child" in error and "Create an Engine in the child" in error
    assert waited < 5

    pid = os.fork()
    if pid == 0:  # a child that shuts the engine down and exits normally (atexit: the engine's finalizer)
        code = 1
        try:
            eng.shutdown()
            atexit._run_exitfuncs()
            code = 0
        finally:
            os._exit(code)
    started = time.monotonic()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and time.monotonic() - started < 5
    assert os.path.isdir(eng._tmpdir)
    assert eng.generate("Hi", GREEDY)["meta_info"]["completion_tokens"] == 3
