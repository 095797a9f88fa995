"""LoRA adapters on the issue's other models (issue 36): a random small Qwen2 (biased QKV, tied embeddings)
with two adapters, and the default model with a random adapter: greedy outputs token for token equal to
transformers with the adapter merged (PEFT's merge_and_unload), alone and in a batch mixing adapters and
the base model."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from conftest import make_random_model  # noqa: E402
from helpers.lora_adapters import make_peft_adapter, merged_greedy  # noqa: E402

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def _check(engine, refs: dict, prompts: list[list[int]], names: list) -> None:
    for name in refs:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=name)
        assert [o["output_ids"] for o in outs] == refs[name], name
    rows = [(name, i) for i in range(len(prompts)) for name in names]  # every step mixes them
    outs = engine.generate(
        input_ids=[prompts[i] for _, i in rows], sampling_params=GREEDY, lora_path=[name for name, _ in rows]
    )
    assert [o["output_ids"] for o in outs] == [refs[name][i] for name, i in rows]
    assert engine.check_integrity()


def test_random_qwen2_with_two_adapters(tmp_path):
    from plait.runtime import Engine

    base = make_random_model(str(tmp_path / "qwen2"), "qwen2")
    adapters = {
        "a": make_peft_adapter(base, str(tmp_path / "a"), 8, seed=21),
        "b": make_peft_adapter(base, str(tmp_path / "b"), 4, seed=22, targets=["k_proj", "o_proj", "up_proj"]),
    }
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    refs = {name: merged_greedy(base, path, prompts, NEW) for name, path in adapters.items()}
    refs[None] = merged_greedy(base, None, prompts, NEW)
    assert refs["a"] != refs[None] and refs["b"] != refs[None]
    paths = [f"{name}={path}" for name, path in adapters.items()]
    with Engine(model_path=base, lora_paths=paths, max_lora_rank=8) as engine:
        _check(engine, refs, prompts, ["a", None, "b"])


def test_default_model_with_a_random_adapter(tmp_path, default_model_path, default_tokenizer):
    from plait.runtime import Engine

    # NOTE: a small spread: the real model's weights are small, and a large random adapter would swamp them.
    adapter = make_peft_adapter(default_model_path, str(tmp_path / "a"), 8, seed=31, scale=0.03)
    prompts = [default_tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    refs = {"a": merged_greedy(default_model_path, adapter, prompts, NEW)}
    refs[None] = merged_greedy(default_model_path, None, prompts, NEW)
    assert refs["a"] != refs[None], "the adapter must change the outputs for the test to mean anything"
    with Engine(lora_paths=[f"a={adapter}"], max_lora_rank=8) as engine:
        _check(engine, refs, prompts, ["a", None])
