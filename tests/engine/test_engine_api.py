"""The Engine API end to end on the real default model (SmolLM2-135M-Instruct): the result's shape, each
sampling parameter and the logprobs. Batches, streams, concurrency, bad input and the lifecycle are in
tests/engine/test_engine_serving.py.

One engine serves the whole module; every generation is short. Expected outputs are derived from a
reference run on the same engine (e.g. a stop string is cut out of the greedy text), so the tests pin
each parameter's effect without hard-coding the model's words.
"""

import json
from collections import Counter

import pytest
from plait.runtime import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 12}
FACT = "The capital of France is"
# A raw (non-chat) prompt after which the model emits EOS at once: ignore_eos / min_new_tokens show.
EOS_AT_ONCE = "Write a long story about a dragon."
REPETITIVE = "the the the the the the the the"


@pytest.fixture(scope="module")
def eng():
    with Engine(num_threads=1, max_total_tokens=4096) as e:
        yield e


@pytest.fixture(scope="module")
def fact_ref(eng):
    return eng.generate(FACT, GREEDY)


def gen(eng, prompt, **params):
    return eng.generate(prompt, params)


# ---------------------------------------------------------------------- result shape
def test_result_has_sglang_shape(eng):
    out = eng.generate(FACT, {"temperature": 0, "max_new_tokens": 3}, rid="shape-test")
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"} <= set(meta)
    assert meta["id"] == "shape-test"
    assert meta["prompt_tokens"] == len(eng.tokenizer.encode(FACT))
    assert meta["completion_tokens"] == len(out["output_ids"]) == 3
    assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] < meta["prompt_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0
    assert out["text"] == eng.tokenizer.decode(out["output_ids"])
    assert "output_token_logprobs" not in meta  # only on request
    json.dumps(out)  # plain data, ready for HTTP


def test_input_ids_give_the_same_result_as_text(eng, fact_ref):
    out = eng.generate(input_ids=eng.tokenizer.encode(FACT), sampling_params=GREEDY)
    assert out["output_ids"] == fact_ref["output_ids"]


# ---------------------------------------------------------------------- sampling parameters
def test_temperature_zero_is_deterministic(eng, fact_ref):
    assert gen(eng, FACT, **GREEDY)["output_ids"] == fact_ref["output_ids"]


def test_top_k_1_equals_greedy(eng, fact_ref):
    out = gen(eng, FACT, temperature=1.0, top_k=1, max_new_tokens=12)
    assert out["output_ids"] == fact_ref["output_ids"]


@pytest.mark.parametrize("narrow", [{"top_p": 0.01}, {"min_p": 1.0}])
def test_top_p_and_min_p_narrowed_to_one_token_equal_greedy(eng, fact_ref, narrow):
    out = gen(eng, FACT, temperature=1.0, max_new_tokens=12, **narrow)
    assert out["output_ids"] == fact_ref["output_ids"]


def test_stop_regex(eng, fact_ref):
    text = fact_ref["text"]
    assert "\n" in text, text
    out = gen(eng, FACT, stop_regex=r"\n+", **GREEDY)
    assert out["text"] == text[: text.index("\n")]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_seed_reproduces_a_sampled_output(eng, fact_ref):
    sampled = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    a = gen(eng, FACT, seed=11, **sampled)["output_ids"]
    b = gen(eng, FACT, seed=11, **sampled)["output_ids"]
    assert a == b
    others = [gen(eng, FACT, seed=s, **sampled)["output_ids"] for s in (12, 13)]
    assert any(o != a for o in others)


def test_max_new_tokens_finishes_with_length(eng, fact_ref):
    out = gen(eng, FACT, temperature=0, max_new_tokens=5)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["output_ids"] == fact_ref["output_ids"][:5]


def _stop_string(ref_text: str) -> tuple[str, str]:
    """A stop string from the middle of the greedy text, and the text before its first occurrence."""
    stripped = ref_text.strip()
    stop = stripped[len(stripped) // 2 : len(stripped) // 2 + 4]
    assert stop.strip(), ref_text
    return stop, ref_text[: ref_text.index(stop)]


def test_stop_string_is_trimmed_and_reported(eng, fact_ref):
    stop, before = _stop_string(fact_ref["text"])
    out = gen(eng, FACT, stop=[stop, "never appears"], **GREEDY)
    assert out["text"] == before
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(out["output_ids"]) < len(fact_ref["output_ids"])

    kept = gen(eng, FACT, stop=stop, no_stop_trim=True, **GREEDY)
    assert kept["text"] == before + stop
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_token_ids(eng, fact_ref):
    ref = fact_ref["output_ids"]
    stop_tok = ref[2]
    out = gen(eng, FACT, stop_token_ids=[stop_tok], **GREEDY)
    end = ref.index(stop_tok) + 1
    assert out["output_ids"] == ref[:end]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["text"] == eng.tokenizer.decode(ref[: end - 1])  # the stop token's text is trimmed


def test_eos_stops_and_ignore_eos_runs_to_max_new_tokens(eng):
    eos = eng.info.eos_token_ids
    natural = gen(eng, EOS_AT_ONCE, temperature=0, max_new_tokens=8)
    assert natural["meta_info"]["finish_reason"]["type"] == "stop"
    assert natural["output_ids"][-1] in eos
    out = gen(eng, EOS_AT_ONCE, temperature=0, max_new_tokens=6, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 6
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_min_new_tokens_bans_eos_until_reached(eng):
    eos = eng.info.eos_token_ids
    out = gen(eng, EOS_AT_ONCE, temperature=0, max_new_tokens=10, min_new_tokens=4)
    ids = out["output_ids"]
    assert len(ids) >= 4
    assert not any(t in eos for t in ids[:4])


def test_n_returns_n_outputs(eng):
    outs = gen(eng, FACT, temperature=1.0, max_new_tokens=6, n=3, seed=5, ignore_eos=True)
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    assert all(o["meta_info"]["completion_tokens"] == 6 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # independent samples


def test_logit_bias_forces_a_token(eng):
    forced = eng.tokenizer.encode(" banana")[0]
    out = gen(eng, FACT, temperature=0, max_new_tokens=4, logit_bias={str(forced): 100.0})
    assert out["output_ids"] == [forced] * 4


@pytest.mark.parametrize(
    "penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5}]
)
def test_penalties_break_a_repetitive_greedy_output(eng, penalty):
    ref = gen(eng, REPETITIVE, **GREEDY)["output_ids"]
    out = gen(eng, REPETITIVE, **GREEDY, **penalty)["output_ids"]
    assert out != ref
    assert max(Counter(out).values()) < max(Counter(ref).values())


# ---------------------------------------------------------------------- logprobs
def test_output_logprobs_fields(eng, fact_ref):
    out = eng.generate(
        FACT,
        {"temperature": 0, "max_new_tokens": 5},
        return_logprob=True,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta, ids = out["meta_info"], out["output_ids"]
    lps, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(lps) == len(tops) == meta["completion_tokens"] == len(ids) == 5
    for (lp, tok, text), top, want in zip(lps, tops, ids):
        assert tok == want and lp <= 0 and text == eng.tokenizer.decode([tok])
        assert len(top) == 3
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy picks the top one
        assert all(isinstance(t[2], str) for t in top)
    assert meta["input_token_logprobs"] == []  # no prompt logprobs unless logprob_start_len is given

    plain = eng.generate(FACT, {"temperature": 0, "max_new_tokens": 2}, return_logprob=True)
    assert all(text is None for _, _, text in plain["meta_info"]["output_token_logprobs"])


def test_prompt_logprobs_from_logprob_start_len(eng):
    n_prompt = len(eng.tokenizer.encode(FACT))
    out = eng.generate(
        FACT, {"temperature": 0, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    lps = out["meta_info"]["input_token_logprobs"]
    assert len(lps) == n_prompt
    assert lps[0][0] is None  # the first token has no context
    assert all(lp is not None and lp <= 0 for lp, _, _ in lps[1:])
    assert [t for _, t, _ in lps] == eng.tokenizer.encode(FACT)
    assert all(len(top) == 2 for top in out["meta_info"]["input_top_logprobs"][1:])

    later = eng.generate(FACT, {"temperature": 0, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=2)
    assert [lp for lp, _, _ in later["meta_info"]["input_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in lps[2:]], abs=1e-4
    )


def test_max_new_tokens_zero_runs_prefill_only(eng, fact_ref):
    prompt_ids = eng.tokenizer.encode(FACT)
    gen_lps = eng.generate(FACT, {"temperature": 0, "max_new_tokens": 3}, return_logprob=True)["meta_info"][
        "output_token_logprobs"
    ]
    # Scoring prompt + generated tokens in one prefill gives the logprobs they were generated with.
    full = prompt_ids + fact_ref["output_ids"][:3]
    out = eng.generate(
        input_ids=full, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=len(prompt_ids)
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == []
    assert [t for _, t, _ in meta["input_token_logprobs"]] == fact_ref["output_ids"][:3]
    assert [lp for lp, _, _ in meta["input_token_logprobs"]] == pytest.approx([lp for lp, _, _ in gen_lps], abs=1e-4)
