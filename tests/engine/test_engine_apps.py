"""The Engine embedded in real applications: offline batch jobs, asyncio apps, worker processes.

A new user's trial of the Engine the way SGLang's / vLLM's offline engines are used; each test pins a
behaviour that was wrong before. One engine serves the module (default model, a few tokens per request).
"""

import atexit
import logging
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


# ---------------------------------------------------------------------- prompts as token ids
def test_token_ids_from_numpy_torch_and_tuples_are_accepted(eng):
    np = pytest.importorskip("numpy")
    import torch

    ids = eng.tokenizer.encode("The capital of France is")
    want = eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    # Before: "input_ids must be ints in [0, 49152)" for in-range numpy ids (list(array)), and
    # "must be a list" for a tuple or an array.
    for given in (tuple(ids), np.array(ids), list(np.array(ids)), torch.tensor(ids)):
        assert eng.generate(input_ids=given, sampling_params=GREEDY)["output_ids"] == want, type(given)
    batch = eng.generate(input_ids=np.array([ids, ids]), sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == [want, want]
    batch = eng.generate(input_ids=[np.array(ids), torch.tensor(ids)], sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == [want, want]


def test_a_chat_template_batch_encoding_is_refused_with_the_fix(eng):
    encoded = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=True, add_generation_prompt=True, return_dict=True
    )
    with pytest.raises(ValueError, match=r"got a BatchEncoding: pass its \['input_ids'\]"):
        eng.generate(input_ids=encoded, sampling_params=GREEDY)
    out = eng.generate(input_ids=encoded["input_ids"], sampling_params=GREEDY)
    assert out["meta_info"]["prompt_tokens"] == len(encoded["input_ids"])


# ---------------------------------------------------------------------- logprobs
def test_logprob_start_len_past_the_prompt_is_an_error_not_an_empty_list(eng):
    ids = eng.tokenizer.encode("The capital of France is")
    last = eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=len(ids) - 1)
    assert len(last["meta_info"]["input_token_logprobs"]) == 1
    for start in (len(ids), len(ids) + 7):
        # Before: input_token_logprobs == [] without a word (SGLang refuses such a request too).
        with pytest.raises(
            ValueError,
            match=rf"logprob_start_len \({start}\) must be less than the prompt's "
            rf"{len(ids)} tokens",
        ):
            eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=start)
    # Without return_logprob the start is not used, as in SGLang.
    assert eng.generate(input_ids=ids, sampling_params=GREEDY, logprob_start_len=len(ids))["output_ids"]


# ---------------------------------------------------------------------- SGLang's API around generate
def test_stream_interval_per_request(eng):
    params = {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True, "stream_interval": 4}
    chunks = list(eng.generate("Once upon a time", params, stream=True))
    # Before: "unknown sampling parameter(s): stream_interval" (SGLang takes it per request).
    # The first token comes at once, then every 4 tokens, and the rest at the end.
    assert [len(c["output_ids"]) for c in chunks] == [1, 5, 9]
    whole = eng.generate("Once upon a time", {**params, "stream_interval": None})
    assert chunks[-1]["text"] == whole["text"]
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        eng.generate("Hi", {"stream_interval": 0})


def test_sglang_engine_methods_plait_lacks_say_so(eng):
    # Before: AttributeError, as for a misspelled name.
    with pytest.raises(
        NotImplementedError,
        match=r"Engine.update_weights_from_disk\(\) \(an SGLang Engine method\) "
        r"is not supported by plait: the weights are loaded once",
    ):
        eng.update_weights_from_disk("/some/checkpoint")
    with pytest.raises(NotImplementedError, match="no embeddings"):
        eng.encode("Hello")
    with pytest.raises(NotImplementedError, match="PLAIT_SCHEDULER_PROFILE"):
        eng.start_profile()
    assert eng.get_tokenizer() is eng.tokenizer


def test_an_engine_sent_to_another_process_is_refused_clearly(eng):
    import pickle

    # Before: "cannot pickle '_thread.lock' object" (e.g. an Engine passed to a multiprocessing pool).
    with pytest.raises(TypeError, match="an Engine cannot be pickled or sent to another process"):
        pickle.dumps(eng)


# ---------------------------------------------------------------------- start-up failures
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_before_a_scheduler_starts():
    started = time.monotonic()
    # Before: the scheduler failed with "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'".
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA device"):
        Engine(device="cuda", num_threads=1)
    assert time.monotonic() - started < 5


def test_a_scheduler_that_reports_its_start_error_is_not_terminated(caplog):
    with caplog.at_level(logging.WARNING, logger="plait.engine"):
        with pytest.raises(RuntimeError, match="context_length 100000 is above this model's limit"):
            Engine(context_length=100000, num_threads=1)
    # Before: it was terminated at once, with a "did not exit; terminating it" warning after its traceback.
    assert not [r for r in caplog.records if "did not exit" in r.getMessage()]
