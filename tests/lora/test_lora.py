"""LoRA adapters (issue 36) on a random small Llama: greedy outputs token for token equal to transformers
with the adapter merged (PEFT's merge_and_unload), alone and in batches mixing adapters and the base, with
more adapters loaded than the device slots hold; the prefix cache keeps adapters and cache salts apart;
adapters loaded and unloaded while requests run; bad adapters refused with errors that name them."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("peft")

from conftest import make_random_model  # noqa: E402
from helpers.lora_adapters import make_peft_adapter, merged_greedy  # noqa: E402
from plait.runtime.lora.adapter import LoraError, LoraShapes, read_adapter  # noqa: E402
from plait.runtime.lora.matmul import LoraBatch  # noqa: E402
from plait.runtime.lora.registry import LoraRegistry  # noqa: E402
from plait.runtime.lora.slots import LoraSlots  # noqa: E402
from plait.runtime.models.config import ModelConfig  # noqa: E402
from plait.runtime.request_options import cache_key_prompt  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [10, 11, 12], [40, 41, 42, 43, 44]]
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base model, three adapters (ranks 8, 4 on some projections, 2) and transformers' references."""
    d = tmp_path_factory.mktemp("lora")
    base = make_random_model(str(d / "base"), "llama")
    adapters = {
        "a": make_peft_adapter(base, str(d / "a"), 8, seed=1),
        "b": make_peft_adapter(base, str(d / "b"), 4, seed=2, targets=["q_proj", "v_proj", "down_proj"]),
        "c": make_peft_adapter(base, str(d / "c"), 2, seed=3, targets=["k_proj", "o_proj", "gate_proj", "up_proj"]),
    }
    refs = {name: merged_greedy(base, path, PROMPTS, NEW) for name, path in adapters.items()}
    refs[None] = merged_greedy(base, None, PROMPTS, NEW)
    for name in adapters:
        assert refs[name] != refs[None], f"adapter {name} must change the outputs for the test to mean anything"
    return base, adapters, refs, d


@pytest.fixture(scope="module")
def engine(models):
    from plait.runtime import Engine

    base, adapters, _, _ = models
    paths = [f"{name}={path}" for name, path in adapters.items()]
    # Two device slots for three adapters: a batch of all three is admitted in turns, and slots are swapped.
    with Engine(model_path=base, lora_paths=paths, max_lora_rank=8, max_loras_per_batch=2) as eng:
        yield eng


def test_one_adapter_matches_transformers_with_it_merged(models, engine):
    _, _, refs, _ = models
    for name in ("a", "b", "c"):
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=name)
        assert [o["output_ids"] for o in outs] == refs[name], name
    assert engine.check_integrity()


def test_a_batch_mixing_three_adapters_and_the_base(models, engine):
    _, _, refs, _ = models
    names = ["a", "b", None, "c"]
    rows = [(name, i) for i in range(len(PROMPTS)) for name in names]  # interleaved: every step mixes them
    swaps = engine.get_stats()["lora"]["swaps"]
    outs = engine.generate(
        input_ids=[PROMPTS[i] for _, i in rows], sampling_params=GREEDY, lora_path=[name for name, _ in rows]
    )
    assert [o["output_ids"] for o in outs] == [refs[name][i] for name, i in rows]
    stats = engine.get_stats()["lora"]
    assert stats["slots"] == 2 and stats["loaded"] == 3 and stats["swaps"] > swaps  # swapped from host memory
    assert engine.check_integrity()


def test_the_prefix_cache_keeps_adapters_and_salts_apart(models, engine):
    from plait.runtime.request_options import RequestOptions

    _, _, refs, _ = models
    prompt = [70 + i for i in range(24)]
    engine.flush_cache()

    def cached(**options) -> int:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, options=RequestOptions(**options))
        return out["meta_info"]["cached_tokens"]

    assert cached() == 0
    assert cached() > 0  # the same text under the base model: cached
    assert cached(lora_path="a") == 0  # under an adapter: another prefix
    assert cached(lora_path="a") > 0
    assert cached(lora_path="b") == 0
    assert cached(cache_salt="tenant-1") == 0  # a salt: another prefix again
    assert cached(cache_salt="tenant-1") > 0
    assert cached(cache_salt="tenant-2") == 0
    assert cached(lora_path="a", cache_salt="tenant-1") == 0
    # and the outputs under an adapter are still its own (no KV of the base model reused)
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a")
    assert out["output_ids"] == refs["a"][0]
    assert engine.check_integrity()


def test_load_and_unload_while_serving(models, engine):
    _, adapters, refs, d = models
    long_run = {}

    def base_request():
        long_run["out"] = engine.generate(
            input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
        )

    thread = threading.Thread(target=base_request)
    thread.start()
    loaded = engine.load_lora_adapter("a2", adapters["a"])  # the same weights under a second name
    assert loaded["rank"] == 8
    out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="a2")
    assert [o["output_ids"] for o in out] == refs["a"]
    assert engine.unload_lora_adapter("a2") is True
    thread.join()
    assert long_run["out"]["output_ids"][:NEW] == refs[None][0]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a2'"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a2")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.unload_lora_adapter("nope")
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("a", adapters["a"])
    assert engine.check_integrity()


def test_bad_adapters_are_refused_naming_what_is_wrong(models, engine, tmp_path):
    base, adapters, _, _ = models
    # rank over --max-lora-rank
    wide = make_peft_adapter(base, str(tmp_path / "wide"), 16, seed=4)
    with pytest.raises(ValueError, match=r"'wide' has rank 16, over the server's limit --max-lora-rank 8"):
        engine.load_lora_adapter("wide", wide)
    # a missing file
    with pytest.raises(ValueError, match=r"'gone'.*adapter_model.safetensors' is missing"):
        os.makedirs(tmp_path / "gone")
        (tmp_path / "gone" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "peft_type": "LORA"}')
        engine.load_lora_adapter("gone", str(tmp_path / "gone"))
    with pytest.raises(ValueError, match=r"'nowhere'.*is not a folder"):
        engine.load_lora_adapter("nowhere", str(tmp_path / "nowhere"))
    # an adapter of another base model (a wider hidden size)
    foreign = tmp_path / "foreign"
    shutil.copytree(adapters["a"], foreign)
    weights = load_file(foreign / "adapter_model.safetensors")
    key = next(k for k in weights if "layers.1.mlp.down_proj.lora_A" in k)
    weights[key] = torch.zeros(8, 96)  # the base's intermediate size is 128
    save_file(weights, foreign / "adapter_model.safetensors")
    with pytest.raises(
        ValueError, match=r"'foreign': layer 1 down_proj.lora_A has shape \(8, 96\), .* \(8, 128\).*another base model"
    ):
        engine.load_lora_adapter("foreign", str(foreign))
    assert "wide" not in engine.get_stats()["lora"]["adapters"]


# ---- the parts alone ----
def _shapes():
    return LoraShapes(num_layers=2, hidden=64, q_size=64, kv_size=32, intermediate=128)


def test_gathered_rows_equal_segments(models):
    """What a CUDA graph runs (each row's A and B gathered by its slot, data on the device) equals the
    eager segments, and base rows (slot 0) are left exactly as the base matmul wrote them."""
    base, adapters, _, _ = models
    shapes = LoraShapes.of(ModelConfig.from_path(base))
    assert shapes == _shapes()
    slots = LoraSlots(shapes, 3, 8, torch.float32, "cpu")
    for slot, name in enumerate(("a", "b", "c"), start=1):
        slots.write(slot, read_adapter(name, adapters[name], shapes, 8))
    request_slots, tokens = [2, 0, 1, 1, 3, 0], [3, 1, 4, 2, 1, 5]
    segmented = LoraBatch.of_rows(slots, request_slots, tokens)
    gathered = LoraBatch(slots, segmented.token_slots)
    torch.manual_seed(0)
    T = sum(tokens)
    for target, fan_in in (("qkv", shapes.hidden), ("o", shapes.q_size), ("gate_up", shapes.hidden)):
        x = torch.randn(T, fan_in)
        base_out = torch.randn(T, slots.b[target].shape[2])
        y1 = segmented.apply(1, target, x, base_out.clone())
        y2 = gathered.apply(1, target, x, base_out.clone())
        torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
        base_rows = segmented.token_slots == 0
        assert torch.equal(y1[base_rows], base_out[base_rows]) and torch.equal(y2[base_rows], base_out[base_rows])
        assert not torch.equal(y1[~base_rows], base_out[~base_rows])


def test_registry_swaps_least_recently_used_slot(models):
    _, adapters, _, _ = models
    reg = LoraRegistry(_shapes(), 8, 2)
    for name in ("a", "b", "c"):
        reg.load(name, adapters[name])
    rows = reg.rows(["a", None, "b"])
    assert rows.slots == [1, 0, 2] and [(s, ad.name) for s, ad in rows.loads] == [(1, "a"), (2, "b")]
    assert reg.rows(["a"]).loads == []  # a stays; b is now the least recently used
    rows = reg.rows(["c", "a"])
    assert rows.slots == [2, 1] and [(s, ad.name) for s, ad in rows.loads] == [(2, "c")]
    assert reg.swaps == 3
    assert reg.rows([None, None]) is None
    assert not reg.admits("b", {"a", "c"}) and reg.admits("a", {"a", "c"}) and reg.admits(None, {"a", "c"})
    with pytest.raises(LoraError, match="in use by 2 request"):
        reg.unload("a", users=2)
    reg.unload("a", users=0)
    with pytest.raises(LoraError, match=r"unknown LoRA adapter 'a' \(loaded: b, c\)"):
        reg.check("a")


def test_cache_key_prompt_marks_namespaces_only():
    ids = [3, 4, 5]
    assert cache_key_prompt(ids, None, None) is ids  # the base model's keys are the ids themselves
    a, s = cache_key_prompt(ids, "a", None), cache_key_prompt(ids, None, "a")
    assert a[2:] == s[2:] == [5] and a[:2] != s[:2] != ids[:2] and a != cache_key_prompt(ids, "b", None)
    assert a == cache_key_prompt(ids, "a", None)  # stable (data-parallel replicas key alike)
    assert all(0 <= t < 2**63 and t % 2**32 == o for t, o in zip(a, ids))  # int64, the token in the low bits
