"""Pipelined prefill steps (runtime/scheduler/overlap.py): the next prefill batch is admitted and launched
before the one in flight is read back.

On the CPU a launch runs synchronously, but the scheduler's bookkeeping is the GPU's: each workload
runs three ways on a tiny random Llama (overlap off; decode pipeline only; decode and prefill
pipelines) and must give the same tokens, the same cached-token counts (no prefix computed twice),
KV accounting that checks out after every step, and every slot back at the end.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from plait.runtime.forward_batch import ForwardMode
from plait.runtime.io_struct import AbortReq, FlushCacheReq
from plait.runtime.request import Req
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.batch import ScheduleBatch
from test_scheduler_state import assert_host_table_matches, make_scheduler, submit

MODES = {"off": (False, False), "decode": (True, False), "on": (True, True)}  # (overlap, pipeline_prefills)
GREEDY = dict(temperature=0, ignore_eos=True)


def scheduler(path, mode: str, **kw):
    s = make_scheduler(path, **kw)
    s.pipeline.overlap, s.pipeline.pipeline_prefills = MODES[mode]
    return s


def check_state(s) -> None:
    s.check_integrity()
    assert s.last_integrity_error is None, s.last_integrity_error
    assert_host_table_matches(s)


def drive(s, max_steps: int = 2000) -> tuple[dict, int]:
    """Step until idle, checking the KV accounting after every step. Returns the final outputs by rid
    and how many prefill batches were launched while another was still in flight."""
    finals, back_to_back = {}, 0
    for _ in range(max_steps):
        before = s.pipeline.pending_prefill
        s.step()
        check_state(s)
        if before is not None and s.pipeline.pending_prefill is not None:
            assert s.pipeline.pending_prefill[0] is not before[0]
            back_to_back += 1
        for o in s.collect_outputs():
            if o.finished_reason is not None:
                finals[o.rid] = o
        if s.is_idle():
            return finals, back_to_back
    raise AssertionError("scheduler did not go idle")


def assert_all_freed(s, total: int) -> None:
    assert s.pipeline.pending is None and s.pipeline.pending_prefill is None
    assert s.kv.cache.protected_size() == 0
    assert s.kv.allocator.available() + s.kv.cache.evictable_size() == total
    assert s.kv.req_to_token.available() == s.kv.req_to_token.size


def summary(finals: dict) -> dict:
    return {rid: (o.new_ids, o.finished_reason, o.cached_tokens) for rid, o in finals.items()}


def fewshot_requests(rng: random.Random, n: int) -> list[tuple[str, list[int], dict]]:
    """`n` requests sharing a 48-token prefix (longer than the in-batch dedup threshold) + 6 own
    tokens; some finish at their first token (max_new_tokens 1, a stop token) or sample none."""
    shared = [rng.randrange(2, 256) for _ in range(48)]
    reqs = []
    for i in range(n):
        sp = dict(max_new_tokens=4, **GREEDY)
        if i % 7 == 3:
            sp["max_new_tokens"] = 1
        elif i % 7 == 5:
            sp = dict(max_new_tokens=5, temperature=0, stop_token_ids=list(range(2, 256)))
        elif i == 6:
            sp["max_new_tokens"] = 0  # prefill only
        reqs.append((f"f{i}", shared + [rng.randrange(2, 256) for _ in range(6)], sp))
    return reqs


def run_all_modes(path, rounds, total: int, **kw) -> dict:
    """`rounds`: functions (previous round's finals -> requests), submitted one round after another.
    Returns mode -> (summary of every final output, cached tokens, back-to-back prefill launches)."""
    results = {}
    for mode in MODES:
        s = scheduler(path, mode, max_total_tokens=total, **kw)
        finals, back_to_back = {}, 0
        for make_round in rounds:
            for rid, ids, sp in make_round(finals):
                submit(s, rid, ids, **sp)
            got, n = drive(s)
            finals.update(got)
            back_to_back += n
        assert_all_freed(s, total)
        results[mode] = (summary(finals), s.stats["cached_tokens"], back_to_back)
        if mode != "on":
            assert back_to_back == 0
    return results


def assert_same_everywhere(results: dict) -> None:
    ref = results["off"]
    for mode in ("decode", "on"):
        assert results[mode][0] == ref[0], mode
        assert results[mode][1] == ref[1], f"{mode}: cached tokens {results[mode][1]} != {ref[1]}"
    assert results["on"][2] > 0, "no prefill batch was launched behind another"


def test_fewshot_stream_same_tokens_and_cached_tokens(random_models):
    rng = random.Random(0)
    reqs = fewshot_requests(rng, 24)
    # NOTE: 64 tokens per batch: the first batch computes the shared prefix once (the others wait for
    # it), then batches of ~9 requests hit it, back to back.
    results = run_all_modes(random_models["llama"], [lambda _: reqs], 4096, max_prefill_tokens=64)
    assert_same_everywhere(results)
    assert results["on"][1] == 23 * 48  # every request but the first hit the whole shared prefix
    finals = results["on"][0]
    assert finals["f3"][1] == {"type": "length", "length": 1} and len(finals["f3"][0]) == 1
    assert finals["f5"][1]["type"] == "stop" and len(finals["f5"][0]) == 1
    assert finals["f6"][0] == [] and finals["f6"][1] == {"type": "length", "length": 0}


def test_tree_rounds_same_tokens_and_cached_tokens(random_models):
    # Round 1: 3 roots x 2 branches (a 40-token root + 6 own tokens); round 2: 2 children of every
    # round-1 request (its whole sequence, outputs included, + 6 own tokens), as bench_rounds' tree.
    rng = random.Random(1)
    roots = [[rng.randrange(2, 256) for _ in range(40)] for _ in range(3)]
    r1 = [(f"a{t}-{b}", roots[t] + [rng.randrange(2, 256) for _ in range(6)]) for t in range(3) for b in range(2)]
    tails = {f"{rid}-{c}": [rng.randrange(2, 256) for _ in range(6)] for rid, _ in r1 for c in range(2)}
    prompts = dict(r1)

    def round1(_):
        return [(rid, ids, dict(max_new_tokens=8, **GREEDY)) for rid, ids in r1]

    def round2(finals):
        return [
            (rid, prompts[rid[:-2]] + finals[rid[:-2]].new_ids + tail, dict(max_new_tokens=8, **GREEDY))
            for rid, tail in tails.items()
        ]

    results = run_all_modes(random_models["llama"], [round1, round2], 4096, max_prefill_tokens=40)
    assert_same_everywhere(results)
    # At least: round 1 hits each root once per sibling; round 2 hits its parent's whole sequence
    # (prompt + outputs but the last, which has no KV). Random tokens may add a coincidental match.
    assert results["on"][1] >= 3 * 40 + 12 * (46 + 7)


def test_chunked_prefill_in_the_pipeline(random_models):
    # 16-token chunks: long prompts (some sharing a 40-token prefix) go through several chunks, each
    # launched while the previous batch is in flight.
    rng = random.Random(2)
    shared = [rng.randrange(2, 256) for _ in range(40)]
    reqs = [
        (
            f"c{i}",
            (shared if i % 2 else []) + [rng.randrange(2, 256) for _ in range(n)],
            dict(max_new_tokens=3, **GREEDY),
        )
        for i, n in enumerate((30, 9, 50, 20, 3, 12))
    ]
    results = run_all_modes(
        random_models["llama"], [lambda _: reqs], 4096, chunked_prefill_size=16, max_prefill_tokens=16
    )
    assert_same_everywhere(results)


@pytest.mark.parametrize("total", [64, 80])
def test_pipeline_under_memory_pressure_matches_ample_memory(random_models, total):
    # A pool too small for every request's decode: chunked requests restart, running ones are
    # retracted; the tokens must still be those of a run with ample memory.
    rng = random.Random(3)
    shared = [rng.randrange(2, 256) for _ in range(36)]
    reqs = [
        (f"m{i}", shared[:n] + [rng.randrange(2, 256) for _ in range(5)], dict(max_new_tokens=12, **GREEDY))
        for i, n in enumerate((36, 10, 36, 0, 20, 36, 5))
    ]
    outs = {}
    for mode, size in (("off", 4096), ("on", total)):
        s = scheduler(
            random_models["llama"], mode, max_total_tokens=size, chunked_prefill_size=16, max_prefill_tokens=32
        )
        for rid, ids, sp in reqs:
            submit(s, rid, ids, **sp)
        finals, back_to_back = drive(s)
        assert_all_freed(s, size)
        if mode == "on":
            assert s.stats["num_retractions"] > 0 and back_to_back > 0
        outs[mode] = {rid: (o.new_ids, o.finished_reason) for rid, o in finals.items()}
    assert outs["on"] == outs["off"]
    assert all(len(ids) == 12 for ids, _ in outs["on"].values())


def test_admission_counts_the_prefill_in_flight_as_running(random_models):
    # 120 slots. "a" (10 tokens, up to 100 new) is in flight: its KV reserve (100 x the new-token
    # ratio, 70 tokens) leaves 40 tokens of budget, too few for "b" (40 tokens + its reserve). Were
    # "a" not counted, "b" would be admitted next to it and the pool over-committed.
    s = scheduler(random_models["llama"], "on", max_total_tokens=120, disable_radix_cache=True)
    submit(s, "a", list(range(2, 12)), max_new_tokens=100, **GREEDY)
    first = s.step()
    assert first.mode.is_extend() and s.pipeline.pending_prefill is not None and s.pipeline.pending_prefill[0] is first
    assert [r.rid for r in s.queues.running] == ["a"] and s.queues.running[0].output_ids == []  # token not read yet
    assert s.shortage.running_reserve() == pytest.approx(100 * s.shortage.new_token_ratio)
    assert not s.is_idle()
    assert s.handle_message(FlushCacheReq(1)).result is False
    submit(s, "b", list(range(20, 60)), max_new_tokens=10, **GREEDY)
    second = s.step()
    assert second.mode.is_decode() and [r.rid for r in second.reqs] == ["a"]  # "a" read back, then decode
    assert [r.rid for r in s.queues.waiting] == ["b"]
    assert len(s.queues.running[0].output_ids) == 1
    check_state(s)


def test_prefix_held_back_in_a_batch_hits_the_tree_while_its_batch_is_in_flight(random_models):
    # q1..q3 share q0's 64 uncached tokens: they wait for q0's batch. Their batch is admitted while
    # q0's is still in flight, so q0's prefix must already be in the tree then.
    s = scheduler(random_models["llama"], "on", max_total_tokens=1024)
    shared = list(range(2, 66))
    for i in range(4):
        submit(s, f"q{i}", shared + [100 + i, 120 + i], max_new_tokens=2, **GREEDY)
    first = s.step()
    assert [r.rid for r in first.reqs] == ["q0"] and s.pipeline.pending_prefill[0] is first
    assert s.kv.cache.peek_prefix_len(shared) == 64  # inserted at launch
    second = s.step()
    # (q0 decodes in the same step, its first token read on the device)
    assert s.pipeline.pending_prefill[0] is second and [r.rid for r in second.decode_reqs] == ["q0"]
    assert sorted(r.rid for r in second.prefill_part()[0]) == ["q1", "q2", "q3"]
    assert second.prefix_lens[1:] == [64, 64, 64] and second.extend_lens[1:] == [2, 2, 2]
    assert len(s.queues.running[0].output_ids) == 1  # q0 was read back after q1..q3 were launched
    drive(s)
    assert s.stats["cached_tokens"] == 3 * 64


def test_aborts_while_a_prefill_is_in_flight(random_models):
    # Aborted while a prefill is in flight: the chunked request whose chunk it is, a running request
    # and a waiting one. The other one produces what it produces without them.
    prompts = {
        "p0": list(range(2, 12)),
        "p1": list(range(30, 45)),
        "long": list(range(50, 110)),
        "w": list(range(120, 130)),
    }
    ref = scheduler(random_models["llama"], "off", max_total_tokens=512, chunked_prefill_size=24, max_prefill_tokens=24)
    for rid in ("p0", "p1"):
        submit(ref, rid, prompts[rid], max_new_tokens=6, **GREEDY)
    expected, _ = drive(ref)

    s = scheduler(random_models["llama"], "on", max_total_tokens=512, chunked_prefill_size=24, max_prefill_tokens=24)
    submit(s, "p0", prompts["p0"], max_new_tokens=6, **GREEDY)
    s.step()  # p0 in flight
    submit(s, "long", prompts["long"], max_new_tokens=6, **GREEDY)
    submit(s, "p1", prompts["p1"], max_new_tokens=6, **GREEDY)
    s.step()  # the first chunk of "long" launched beside p0's next token, p0 read back
    batch = s.pipeline.pending_prefill[0]
    assert [r.rid for r in batch.reqs] == ["p0", "long"] and batch.num_decode == 1
    assert batch.extend_lens == [1, 23] and s.queues.chunked is batch.reqs[1]  # (the decode token counts)
    assert [r.rid for r in s.queues.running] == ["p0"] and [r.rid for r in s.queues.waiting] == ["p1"]
    submit(s, "w", prompts["w"], max_new_tokens=6, **GREEDY)
    for rid in ("p0", "long", "w"):
        s.handle_message(AbortReq(rid))
    check_state(s)
    finals, _ = drive(s)
    assert {rid: o.finished_reason["type"] for rid, o in finals.items()} == {
        "p0": "abort",
        "p1": "length",
        "long": "abort",
        "w": "abort",
    }
    assert finals["p1"].new_ids == expected["p1"].new_ids
    assert_all_freed(s, 512)


def test_abort_of_a_request_whose_first_token_is_in_flight(random_models):
    s = scheduler(random_models["llama"], "on", max_total_tokens=256)
    submit(s, "x", list(range(2, 40)), max_new_tokens=8, **GREEDY)
    s.step()
    assert s.pipeline.pending_prefill is not None
    s.handle_message(AbortReq("x"))
    finals, _ = drive(s)
    assert finals["x"].finished_reason["type"] == "abort" and finals["x"].new_ids == []
    assert_all_freed(s, 256)


def test_logprob_requests_are_not_pipelined_and_get_their_logprobs(random_models):
    # A batch with a logprob request runs synchronously (its prompt logprobs are read on the host);
    # the one in flight before it is read back first.
    outs = {}
    for mode in ("off", "on"):
        s = scheduler(random_models["llama"], mode, max_total_tokens=512)
        submit(s, "plain", list(range(2, 20)), max_new_tokens=3, **GREEDY)
        s.step()
        assert (s.pipeline.pending_prefill is not None) == (mode == "on")
        s.handle_message(_logprob_req("lp", list(range(40, 60))))
        second = s.step()
        assert [r.rid for r in second.prefill_part()[0]] == ["lp"] and s.pipeline.pending_prefill is None
        assert [r.rid for r in second.decode_reqs] == ["plain"]  # its next token in the same forward
        finals, _ = drive(s)
        outs[mode] = {rid: (o.new_ids, o.input_token_logprobs, o.output_token_logprobs) for rid, o in finals.items()}
    assert outs["on"] == outs["off"]
    assert len(outs["on"]["lp"][1]) == 20  # the first prompt token has no logprob: (None, id, text)


def _logprob_req(rid: str, ids: list[int]):
    from plait.runtime.io_struct import TokenizedGenerateReq

    return TokenizedGenerateReq(
        ids,
        SamplingParams(max_new_tokens=3, **GREEDY),
        RequestOptions(rid=rid, return_logprob=True, logprob_start_len=0),
    )


def test_launch_prefill_resolves_to_what_run_returns(random_models):
    # The model runner alone: one EXTEND batch with a sampling request, a chunk mid-way and a
    # prefill-only request, launched and resolved, against run() on a twin scheduler's runner.
    outs = []
    for launch in (False, True):
        s = make_scheduler(random_models["llama"], max_total_tokens=256, disable_radix_cache=True)
        reqs = [
            Req("a", list(range(2, 14)), SamplingParams(max_new_tokens=4, **GREEDY)),
            Req("b", list(range(20, 50)), SamplingParams(max_new_tokens=4, **GREEDY)),
            Req("c", list(range(60, 66)), SamplingParams(max_new_tokens=0)),
        ]
        extend = [12, 10, 6]  # "b": a chunk mid-way (no token)
        for r in reqs:
            r.req_pool_idx = s.kv.req_to_token.alloc()
        batch = ScheduleBatch(ForwardMode.EXTEND, reqs, [0, 0, 0], extend, s.kv.allocator.alloc(sum(extend)))
        mr = s.runner
        outs.append(mr.resolve(mr.launch(batch.to_step())) if launch else mr.run(batch.to_step()))
    ran, resolved = outs
    assert resolved.next_token_ids == ran.next_token_ids
    assert resolved.next_token_ids[1:] == [None, None] and isinstance(resolved.next_token_ids[0], int)
    assert resolved.input_logprobs == [[], [], []] and resolved.output_logprobs == [None] * 3


def test_launch_prefill_refuses_a_batch_that_wants_prompt_logprobs(random_models):
    s = make_scheduler(random_models["llama"], max_total_tokens=64, disable_radix_cache=True)
    r = Req(
        "a",
        list(range(2, 10)),
        SamplingParams(max_new_tokens=2),
        RequestOptions(return_logprob=True, logprob_start_len=0),
    )
    r.req_pool_idx = s.kv.req_to_token.alloc()
    batch = ScheduleBatch(ForwardMode.EXTEND, [r], [0], [8], s.kv.allocator.alloc(8))
    with pytest.raises(ValueError, match="prompt logprobs"):
        s.runner.launch(batch.to_step())


def test_sampled_prefills_in_the_pipeline_reproduce_with_seeds(random_models):
    # Non-greedy requests with seeds sample on the device at launch: the same tokens as without it.
    outs = {}
    for mode in ("off", "on"):
        s = scheduler(random_models["llama"], mode, max_total_tokens=512, max_prefill_tokens=24)
        for i in range(5):
            submit(
                s,
                f"s{i}",
                list(range(2 + 10 * i, 22 + 10 * i)),
                max_new_tokens=5,
                temperature=0.8,
                top_p=0.9,
                seed=100 + i,
                ignore_eos=True,
            )
        finals, back_to_back = drive(s)
        assert back_to_back > 0 if mode == "on" else back_to_back == 0
        outs[mode] = {rid: o.new_ids for rid, o in finals.items()}
    assert outs["on"] == outs["off"]


def test_failure_with_a_prefill_in_flight_aborts_everything(random_models):
    s = scheduler(random_models["llama"], "on", max_total_tokens=256)
    submit(s, "a", list(range(2, 12)), max_new_tokens=4, **GREEDY)
    s.step()
    assert s.pipeline.pending_prefill is not None
    s.fail_all("RuntimeError: device lost")
    finals = {o.rid: o for o in s.collect_outputs()}
    assert finals["a"].finished_reason["type"] == "abort"
    assert s.is_idle() and s.pipeline.pending_prefill is None


def test_grammar_requests_are_not_pipelined(default_model_path):
    # A regex-constrained request needs its mask filled on the host before sampling: its prefill runs
    # synchronously, after the plain request's batch in flight is read back.
    from plait.runtime.io_struct import TokenizedGenerateReq
    from plait.runtime.scheduler.scheduler import create_scheduler
    from plait.runtime.server_args import ServerArgs

    torch.manual_seed(0)
    s = create_scheduler(
        ServerArgs(model_path=default_model_path, device="cpu", max_total_tokens=512), default_model_path
    )
    s.pipeline.overlap = True
    tok = s.tokenizer
    submit(s, "plain", tok.encode("Count: one, two,"), max_new_tokens=2, **GREEDY)
    s.step()
    assert s.pipeline.pending_prefill is not None
    s.handle_message(
        TokenizedGenerateReq(
            tok.encode("A number:"),
            SamplingParams(max_new_tokens=4, temperature=0, regex="[0-9]{3}"),
            RequestOptions(rid="g"),
        )
    )
    for _ in range(200):  # the grammar compiles on a worker thread
        if not s.queues.grammar_pending:
            break
        s.grammars.poll()
        time.sleep(0.05)
    second = s.step()
    assert [r.rid for r in second.prefill_part()[0]] == ["g"] and s.pipeline.pending_prefill is None
    finals, _ = drive(s)
    assert finals["g"].finished_reason["type"] in ("stop", "length")
    text = tok.decode(finals["g"].new_ids)
    assert text[:3].isdigit(), text


@pytest.mark.gpu
def test_on_the_gpu_pipelined_prefills_match_synchronous_steps(random_models):
    # The real asynchronous path (pinned host copies, events, stream order of the KV writes against the
    # next batch's reads): overlap scheduling on (the default) against disable_overlap_schedule.
    from plait.runtime.scheduler.scheduler import create_scheduler
    from plait.runtime.server_args import ServerArgs

    path = random_models["llama"]
    reqs = fewshot_requests(random.Random(0), 24)
    results = {}
    for disable in (True, False):
        s = create_scheduler(
            ServerArgs(
                model_path=path,
                device="cuda",
                dtype="float32",
                max_total_tokens=4096,
                max_prefill_tokens=64,
                disable_overlap_schedule=disable,
            ),
            path,
        )
        assert s.pipeline.overlap is not disable
        for rid, ids, sp in reqs:
            submit(s, rid, ids, **sp)
        finals, back_to_back = drive(s)
        assert (back_to_back > 0) is not disable
        assert_all_freed(s, 4096)
        results[disable] = (summary(finals), s.stats["cached_tokens"])
    assert results[False] == results[True]
    assert results[False][1] == 23 * 48
