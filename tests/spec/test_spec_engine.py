"""Speculative decoding through the whole stack: one Engine (its scheduler process, ZMQ, the tokenizer manager)
on the default model with NGRAM prompt lookup. Greedy output equals transformers' token for token;
meta_info carries each request's verify steps and accepted drafts; streaming, stop strings and n > 1
behave as without speculation; get_stats has the counters other parts read."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

PASSAGE = (
    "Maple syrup takes about forty litres of sap to make one litre of syrup. The sap runs when nights are "
    "below freezing and days are above it, usually for four to six weeks in early spring."
)


@pytest.fixture(scope="module")
def engine():
    from plait.runtime import Engine

    # NOTE: the cost model off (every proposed draft verified): on this CPU it finds a verify step of a few
    # tokens too dear for the default model and would verify none; here the stack's handling of drafts is
    # under test, not that choice (tests/spec/test_spec_scheduler.py tests the choice on a fake runner).
    eng = Engine(num_threads=1, max_total_tokens=4096, speculative_algorithm="NGRAM", disable_speculative_adaptive=True)
    yield eng
    eng.shutdown()


def chat(eng, text: str) -> str:
    return eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_greedy_output_equals_transformers_and_meta_info_counts_the_drafts(engine, hf_default_model):
    prompt = chat(engine, f"Repeat this passage word for word: {PASSAGE}")
    # (48 tokens: the default model paraphrases the passage, so prompt lookup finds its matches late)
    out = engine.generate(prompt, {"max_new_tokens": 48, "temperature": 0})
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert out["output_ids"] == hf_greedy(hf_default_model, ids, 48, eos_ids=[engine.tokenizer.eos_token_id])
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] > 0 and 0 < meta["spec_accepted_tokens"] <= meta["spec_draft_tokens"]
    # fewer steps than tokens: each verify step gave the accepted drafts and one more
    assert meta["spec_verify_ct"] + meta["spec_accepted_tokens"] <= meta["completion_tokens"]
    stats = engine.get_stats()
    assert isinstance(stats["avg_spec_accept_length"], float) and stats["avg_spec_accept_length"] > 1.0
    assert stats["spec_verify_steps"] >= meta["spec_verify_ct"]
    assert stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert engine.check_integrity()


def test_streaming_stop_strings_and_n_samples(engine):
    prompt = chat(engine, f"Repeat this passage word for word: {PASSAGE}")
    # (the default model paraphrases: "The process of making maple syrup is a labor of love and a delicate balance")
    params = {"max_new_tokens": 40, "temperature": 0, "stop": ["balance"]}
    whole = engine.generate(prompt, params)
    assert "balance" not in whole["text"] and whole["meta_info"]["finish_reason"]["matched"] == "balance"

    chunks = list(engine.generate(prompt, params, stream=True))
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert len(chunks) > 1
    outs = engine.generate([prompt] * 2, {"max_new_tokens": 16, "temperature": 0.8, "n": 2})
    assert len(outs) == 4 and all(o["meta_info"]["completion_tokens"] > 0 for o in outs)
    assert engine.check_integrity()


def test_a_draft_model_of_another_vocabulary_fails_the_engine_start_with_the_reason(random_models, tmp_path):
    import json
    import shutil

    from plait.runtime import Engine

    draft = shutil.copytree(random_models["llama"], tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(RuntimeError, match="the scheduler failed to start.*vocabulary of 300 tokens, the target 256"):
        Engine(
            model_path=random_models["llama"],
            num_threads=1,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(draft),
        )
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        Engine(model_path=random_models["llama"], speculative_algorithm="EAGLE3")
