"""LoRA adapters on a model split over ranks and with speculative decoding (issue 36), on the CPU: each rank
its own process (gloo over loopback), a batch mixing two adapters and the base model token for token
equal to one device's and to transformers with each adapter merged (PEFT's merge_and_unload); an adapter
loaded while serving reaches every rank (each writes its own part of it); NGRAM drafts verified with
each request's adapter give the outputs plain decoding gives. Each rank holds its part of each adapter,
cut as its base layers are (runtime/lora/shard.py): a unit test checks the parts add up to the whole."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from conftest import make_random_model  # noqa: E402
from helpers.lora_adapters import make_peft_adapter, merged_greedy  # noqa: E402
from helpers.scheduler_loop import run_until_idle
from plait.runtime import Engine  # noqa: E402
from plait.runtime.lora.adapter import TARGETS, LoraShapes, read_adapter  # noqa: E402
from plait.runtime.lora.matmul import LoraBatch  # noqa: E402
from plait.runtime.lora.shard import LoraShard  # noqa: E402
from plait.runtime.lora.slots import LoraSlots  # noqa: E402
from plait.runtime.models.config import ModelConfig  # noqa: E402
from plait.runtime.models.parallel import TensorParallel, projection_slices  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# Prompts that repeat themselves: NGRAM finds drafts in them.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 13, 10, 11, 12], [40, 41, 42, 43, 44, 40, 41]]
NEW = 16
LONG = 64
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
SMALL = dict(num_threads=1, max_total_tokens=2048, max_lora_rank=8, max_loras_per_batch=2)
NAMES = ["a", None, "b"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base (4 query heads, 2 KV heads, 128 MLP columns: 2 + 1 heads and 64 columns a rank at TP = 2),
    two adapters (rank 8 on every projection; rank 4 on q, v and down) and transformers' references."""
    d = tmp_path_factory.mktemp("lora_parallel")
    base = make_random_model(str(d / "base"), "llama")
    adapters = {
        "a": make_peft_adapter(base, str(d / "a"), 8, seed=1),
        "b": make_peft_adapter(base, str(d / "b"), 4, seed=2, targets=["q_proj", "v_proj", "down_proj"]),
    }
    refs = {name: merged_greedy(base, path, PROMPTS, NEW) for name, path in adapters.items()}
    refs[None] = merged_greedy(base, None, PROMPTS, NEW)
    for name in adapters:
        assert refs[name] != refs[None], f"adapter {name} must change the outputs for the test to mean anything"
    return base, adapters, refs


def mixed_batch(engine: Engine, names=NAMES, new_tokens: int = NEW) -> tuple[list, list]:
    """Every prompt under every name in one call (interleaved: each step mixes them): (rows, output ids)."""
    rows = [(name, i) for i in range(len(PROMPTS)) for name in names]
    outs = engine.generate(
        input_ids=[PROMPTS[i] for _, i in rows],
        sampling_params={**GREEDY, "max_new_tokens": new_tokens},
        lora_path=[name for name, _ in rows],
    )
    return rows, [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def one_device(models):
    """One device's outputs of the mixed batch: NEW tokens, and LONG (enough for NGRAM to find drafts)."""
    base, adapters, _ = models
    with Engine(model_path=base, lora_paths=[f"{n}={p}" for n, p in adapters.items()], **SMALL) as eng:
        yield {NEW: mixed_batch(eng)[1], LONG: mixed_batch(eng, new_tokens=LONG)[1]}


def test_tp2_mixed_adapters_equal_one_device_and_transformers(models, one_device):
    base, adapters, refs = models
    with Engine(model_path=base, tp_size=2, lora_paths=[f"a={adapters['a']}"], **SMALL) as eng:
        # "b" loaded while serving: rank 0's registry alone reads it; its slot writes reach every rank
        # with the step plans, each rank writing its own part.
        assert eng.load_lora_adapter("b", adapters["b"])["rank"] == 4
        rows, got = mixed_batch(eng)
        assert got == one_device[NEW]
        assert got == [refs[name][i] for name, i in rows]
        # a third adapter with two slots: slots are swapped, on every rank alike
        eng.load_lora_adapter("b2", adapters["b"])
        rows, got = mixed_batch(eng, ["a", "b2", None])
        assert got == [refs["b" if name == "b2" else name][i] for name, i in rows]
        assert eng.get_stats()["lora"]["swaps"] >= 3
        assert eng.unload_lora_adapter("b2") is True
        assert eng.check_integrity()


def test_pp2_mixed_adapters_equal_transformers(models, one_device):
    # Each stage holds its own layer's part of every adapter; the micro-batches carry their rows' slots.
    base, adapters, refs = models
    with Engine(model_path=base, pp_size=2, lora_paths=[f"{n}={p}" for n, p in adapters.items()], **SMALL) as eng:
        rows, got = mixed_batch(eng)
        assert eng.check_integrity()
    assert got == one_device[NEW] == [refs[name][i] for name, i in rows]


def test_ngram_speculation_with_adapters_gives_plain_decoding(models, one_device):
    base, adapters, refs = models
    paths = [f"{n}={p}" for n, p in adapters.items()]
    # (every proposed draft verified, whatever the cost model would say, at the batch of 9)
    spec = dict(
        speculative_algorithm="NGRAM",
        speculative_ngram_min_match_window_size=1,
        disable_speculative_adaptive=True,
        speculative_disable_by_batch_size=16,
    )
    with Engine(model_path=base, lora_paths=paths, **spec, **SMALL) as eng:
        rows, got = mixed_batch(eng, new_tokens=LONG)
        stats = eng.get_stats()
        assert eng.check_integrity()
    assert got == one_device[LONG]
    # the drafts were verified (with each request's adapter), and some were right (by chance: random
    # weights copy nothing)
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


def test_drafters_without_adapters_are_refused(models):
    from plait.runtime.server_args import ServerArgs

    base, adapters, _ = models
    with pytest.raises(ValueError, match="speculative_algorithm='EAGLE'.*has no adapters.*NGRAM does run"):
        ServerArgs(
            model_path=base,
            lora_paths=[f"a={adapters['a']}"],
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=base,
        )


def _delta(slots: LoraSlots, target: str, x: torch.Tensor) -> torch.Tensor:
    """(T, out) the adapter in slot 1 adds to projection `target` of layer 1 over x (T, in)."""
    y = torch.zeros(x.shape[0], sum(slots.out_splits[target]))
    return LoraBatch(slots, torch.ones(x.shape[0], dtype=torch.int64)).apply(1, target, x, y)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv heads sharded", "kv head replicated"])
def test_the_ranks_parts_add_up_to_the_whole_adapter(models, kv_heads):
    """At TP = 2, cut where the checkpoint's weights are (projection_slices): a column-parallel projection's
    output on a rank is the whole adapter's output at the rank's rows, sub-projection by sub-projection
    (q | k | v, gate | up); a row-parallel one's whole output is the sum of the ranks' partial sums."""
    base, adapters, _ = models
    cfg = ModelConfig.from_path(base)
    adapter = read_adapter("a", adapters["a"], LoraShapes.of(cfg), 8)
    if kv_heads == 1:  # as an adapter of a model with one KV head: k's and v's first head alone
        cfg.num_key_value_heads = 1
        for m in ("k_proj", "v_proj"):
            a, b = adapter.weights[m]
            adapter.weights[m] = (a, b[:, : cfg.head_dim].contiguous())
    shapes = LoraShapes.of(cfg)
    whole = LoraSlots(shapes, 1, 8, torch.float32, "cpu")
    whole.write(1, adapter)
    parts = []
    for rank in range(2):
        part = LoraSlots(
            shapes, 1, 8, torch.float32, "cpu", LoraShard.of(projection_slices(cfg, TensorParallel(rank, 2)))
        )
        part.write(1, adapter)
        parts.append(part)
    torch.manual_seed(0)
    for target in TARGETS:
        fan_in = shapes.in_features(target)
        x = torch.randn(5, fan_in)  # (T, in)
        want = _delta(whole, target.name, x)  # (T, out)
        if target.name in ("qkv", "gate_up"):
            want_subs = want.split(whole.out_splits[target.name], dim=1)
            for part in parts:
                got_subs = _delta(part, target.name, x).split(part.out_splits[target.name], dim=1)
                for module, got, full in zip(target.modules, got_subs, want_subs):
                    _, start, stop = part.shard.cuts[module]
                    torch.testing.assert_close(got, full[:, start:stop], rtol=1e-5, atol=1e-5)
        else:
            (module,) = target.modules
            got = 0
            for part in parts:
                _, start, stop = part.shard.cuts[module]
                got = got + _delta(part, target.name, x[:, start:stop])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_ngram_verify_graphs_with_adapters_equal_plain_decoding_on_the_gpu(models):
    """The verify steps' CUDA graphs read each node's adapter slot as data (executor/verify_graphs.py): NGRAM
    with them gives what plain decoding (the decode graphs) gives, the batch mixing two adapters and the base."""
    from plait.runtime.io_struct import TokenizedGenerateReq
    from plait.runtime.request_options import RequestOptions
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.scheduler import create_scheduler
    from plait.runtime.server_args import ServerArgs

    base, adapters, _ = models
    paths = [f"{n}={p}" for n, p in adapters.items()]

    def scheduler(**kw):
        sa = ServerArgs(model_path=base, device="cuda", dtype="float32", lora_paths=paths, **SMALL, **kw)
        return create_scheduler(sa, base)

    def run(s) -> dict:
        for i, prompt in enumerate(PROMPTS):
            for name in NAMES:
                s.handle_message(
                    TokenizedGenerateReq(
                        list(prompt),
                        SamplingParams(max_new_tokens=LONG, temperature=0, ignore_eos=True),
                        RequestOptions(rid=f"{name}-{i}", lora_path=name),
                    )
                )
        return run_until_idle(s)

    plain = run(scheduler())
    spec = scheduler(
        speculative_algorithm="NGRAM",
        speculative_ngram_min_match_window_size=1,
        disable_speculative_adaptive=True,
        speculative_disable_by_batch_size=16,
    )
    assert spec.runner.verify.graphs is not None and spec.runner.verify.graphs.lora is not None
    assert run(spec) == plain
    stats = spec.get_stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
