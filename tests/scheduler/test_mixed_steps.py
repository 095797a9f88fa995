"""Mixed steps change how a request's tokens are batched, never which tokens it gets: greedy outputs of the
embedded model are token for token the same with mixed steps on and off, at several token budgets, with
steps planned past the one in flight or not, with the prefix cache, grammars, stop strings, samples of one
prompt (n > 1), retraction and speculation. Requests arrive while others decode (the case mixed steps are
for), on a fixed schedule of steps.

One model runner serves every configuration (a scheduler is cheap; the model is not): each run ends with
every slot back in the pool, which the next run starts from.
"""

from __future__ import annotations

import pytest
import torch
from plait.runtime.executor.model_files import load_tokenizer
from plait.runtime.executor.model_runner import ModelRunner
from plait.runtime.io_struct import FlushCacheReq, TokenizedGenerateReq
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs

POOL = 4096


@pytest.fixture(scope="module")
def model(default_model_path):
    torch.manual_seed(0)
    args = ServerArgs(model_path=default_model_path, device="cpu", max_total_tokens=POOL)
    return ModelRunner(args, default_model_path), load_tokenizer(default_model_path)


def workload(tok) -> dict[int, list[tuple[str, list[int], dict]]]:
    """Requests by the step they arrive at."""
    system = tok.encode("You are a careful assistant. Answer in one short sentence, then stop. " * 3)
    greedy = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
    return {
        0: [
            ("a", system + tok.encode("Name a colour."), greedy),
            ("b", tok.encode("Count: one, two, three,"), dict(greedy, max_new_tokens=20)),
        ],
        2: [
            ("c", system + tok.encode("Name a fruit."), greedy),  # hits a's cached system prompt
            ("n-0", tok.encode("The capital of France is"), greedy),  # two samples of one prompt
            ("n-1", tok.encode("The capital of France is"), greedy),
        ],
        3: [
            ("g", tok.encode("A year:"), dict(temperature=0, max_new_tokens=8, regex="(19|20)[0-9]{2}")),
            ("stop", tok.encode("List: apples, pears,"), dict(greedy, stop=[","])),
        ],
        5: [("long", tok.encode("Once upon a time, in a land far away, " * 6), dict(greedy, max_new_tokens=10))],
        9: [("late", system + tok.encode("Name an animal."), greedy)],
    }


def run(model, overlap: bool = False, pool: int = POOL, **settings) -> dict:
    runner, tok = model
    args = ServerArgs(model_path="embedded", device="cpu", **settings)
    s = Scheduler(args, runner, tok)
    s.pipeline.overlap = overlap  # the GPU's pipelined path (synchronous on the CPU)
    if pool < POOL:
        s.shortage.new_token_ratio = 0.1  # an admission reserve at its floor: the pool is over-committed
    arrivals = workload(tok)
    finals, mixed = {}, 0
    for t in range(2000):
        for rid, ids, sp in arrivals.get(t, []):
            s.handle_message(TokenizedGenerateReq(list(ids), SamplingParams(**sp), RequestOptions(rid=rid)))
        batch = s.step()
        mixed += batch is not None and batch.num_decode > 0
        for o in s.collect_outputs():
            if o.finished_reason is not None:
                finals[o.rid] = (o.new_ids, o.finished_reason["type"])
        if s.is_idle() and t > max(arrivals):
            break
    assert s.check_integrity(), s.last_integrity_error
    assert s.handle_message(FlushCacheReq(0)).result is True and s.kv.available() == pool
    steps = s.timer.report()
    return {"outputs": finals, "mixed_steps": mixed, "retractions": s.stats["num_retractions"], "steps": steps}


@pytest.fixture(scope="module")
def reference(model):
    ref = run(model, disable_mixed_chunk=True)
    assert ref["mixed_steps"] == 0 and len(ref["outputs"]) == 9
    assert all(kind in ("stop", "length") for _, kind in ref["outputs"].values())
    return ref["outputs"]


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(overlap=True),
        dict(max_num_batched_tokens=16, chunked_prefill_size=16),
        dict(disable_radix_cache=True, max_num_batched_tokens=48, chunked_prefill_size=48, overlap=True),
        dict(long_prefill_token_threshold=8, overlap=True),  # every prompt here is longer: each cut, one at a time
    ],
    ids=["default", "overlap", "budget16", "no-cache-budget48-overlap", "long-prefill8-overlap"],
)
def test_greedy_outputs_are_the_same_with_mixed_steps(model, reference, settings):
    got = run(model, **settings)
    assert got["mixed_steps"] > 0
    assert got["outputs"] == reference
    if settings.get("overlap"):  # most decode steps are launched behind the step in flight, not after a read-back
        steps = got["steps"]
        assert steps["decode_restarts"] < steps["decode"]["steps"] / 2, steps
        if settings == dict(overlap=True):  # and the counter counts: this schedule restarts decoding after a read-back
            assert steps["decode_restarts"] > 0, steps


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_outputs_are_the_same_with_mixed_steps_and_speculation(model, reference, overlap):
    # (overlap: steps planned past the one in flight, speculation asked first unless a prefill is next)
    got = run(model, overlap, speculative_algorithm="NGRAM", max_num_batched_tokens=32, chunked_prefill_size=32)
    assert got["mixed_steps"] > 0 and got["outputs"] == reference


def test_greedy_outputs_are_the_same_with_mixed_steps_under_retraction(default_model_path, reference):
    # A pool too small for everyone at once: running requests start over and prefill again, mixed.
    torch.manual_seed(0)
    small = ServerArgs(model_path=default_model_path, device="cpu", max_total_tokens=160)
    runner, tok = ModelRunner(small, default_model_path), load_tokenizer(default_model_path)
    got = run((runner, tok), pool=160, max_num_batched_tokens=32, chunked_prefill_size=32)
    assert got["mixed_steps"] > 0 and got["retractions"] > 0
    assert got["outputs"] == reference


def test_greedy_outputs_are_the_same_with_mixed_steps_run_in_pieces(model, reference):
    # Piecewise CUDA graphs' path (executor/piecewise_graphs.py) without the graphs: each layer's work before
    # and after its attention over padded static buffers, the attention between on the real rows.
    from plait.runtime.executor.piecewise_graphs import PiecewiseGraphs

    runner, _ = model
    pieces = PiecewiseGraphs(runner.model, runner.memory, 40, capture=False)
    assert pieces.sizes == [16, 32]  # (40 rounds down to the captured sizes: steps of 33+ tokens run eagerly)
    runner.forward.piecewise = pieces
    try:
        got = run(model, overlap=True, max_num_batched_tokens=24, chunked_prefill_size=24)
    finally:
        runner.forward.piecewise = None
    assert got["mixed_steps"] > 0 and pieces.replays > got["mixed_steps"]  # (decode steps above too: no graphs)
    assert got["outputs"] == reference


def test_piecewise_graphs_by_default_hold_a_512_token_prompt_beside_a_running_batch():
    # A serving stream's typical mixed step is one arriving prompt's chunk plus every running request's decode
    # row: above the largest graph it runs eagerly, at about twice a graphed step's time (H100, 8B shape).
    from plait.runtime.executor.piecewise_graphs import piecewise_sizes
    from plait.runtime.server_args import ServerArgs

    sizes = piecewise_sizes(ServerArgs(model_path="m").piecewise_cuda_graph_max_tokens)
    assert sizes[-1] >= 512 + 64 and 576 in sizes  # 64 decode rows beside a 512-token chunk: 8% padding
    assert sizes == sorted(set(sizes)) and sizes[0] == 16 and piecewise_sizes(40) == [16, 32]


def test_piecewise_graphs_take_only_the_sizes_the_free_memory_affords(model):
    # Each captured size keeps its hand-off tensors: on a GPU left with little memory after the KV pool the
    # largest sizes are dropped (a warning says so) instead of failing the start-up with an out-of-memory error.
    from plait.runtime.executor.piecewise_graphs import MEMORY_SHARE, PiecewiseGraphs, affordable_max_tokens

    runner, _ = model
    per = PiecewiseGraphs.bytes_per_token(runner.model)
    cfg = runner.model.config
    assert per == (cfg.num_hidden_layers * 2 * cfg.hidden_size + cfg.hidden_size) * 4  # float32, H * D == hidden
    sizes_up_to = lambda top: sum(s for s in [16, 32, 64, 96, 128, 160, 192, 224, 256] if s <= top)  # noqa: E731
    plenty = 10 * sizes_up_to(256) * per
    assert affordable_max_tokens(256, per, int(plenty)) == 256
    just = int(sizes_up_to(128) * per / MEMORY_SHARE)  # exactly the sizes up to 128
    assert affordable_max_tokens(256, per, just) == 128 and affordable_max_tokens(256, per, just - 1) == 96
    assert affordable_max_tokens(1024, per, 0) == 0
