"""Sampling parameters mean what they mean in SGLang / vLLM, checked against a float64 reference.

Unit level (synthetic logits, no model): the distribution the sampler draws from equals a float64
reference (transformers' warpers where the semantics are shared), and the draws follow it (support
exactly, chi-square on the counts; fixed seeds, so every run is the same). End to end on the embedded
SmolLM2-135M: logprobs equal transformers', repetition_penalty equals transformers' greedy generate,
first-token draws follow the reference built from transformers' logits, stops and finish reasons, seeds.
"""

import math

import pytest
import torch
from plait.runtime import Engine
from plait.runtime.executor.sampler import SamplingBatchInfo, apply_logit_adjustments, sample, sampling_probs
from plait.runtime.request import Req
from plait.runtime.sampling_params import SamplingParams
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Spread out enough that every filter below cuts somewhere different.
LOGITS = [3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -5.0]
V = len(LOGITS)


def make_reqs(n: int, prompt=(1,), output=(), vocab=V, **params) -> list[Req]:
    sp = SamplingParams.from_dict(params)
    sp.verify(vocab)
    reqs = [Req(f"r{i}", list(prompt), sp, eos_token_ids=()) for i in range(n)]
    for r in reqs:
        r.output_ids[:] = list(output)
    return reqs


def adjusted(rows: torch.Tensor, reqs: list[Req]):
    """(B, V) logits after bias / penalties / bans, as the model runner applies them, and the batch info."""
    rows = rows.clone()
    info = SamplingBatchInfo.from_rows([r.sampling for r in reqs], rows.shape[1], "cpu")
    apply_logit_adjustments(rows, [r.sampling for r in reqs], info)
    return rows, info


def reference(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """float64 SGLang semantics: greedy below 1e-6 or top_k == 1; else temperature, then top-k, top-p
    and min-p judged jointly on the tempered distribution, renormalized."""
    x = torch.as_tensor(logits, dtype=torch.float64)
    if temperature <= 1e-6 or top_k == 1:
        return torch.nn.functional.one_hot(x.argmax(), len(x)).double()
    p = torch.softmax(x / temperature, -1)
    sp, order = p.sort(descending=True)
    keep = (sp.cumsum(0) - sp) < top_p  # the smallest prefix whose mass reaches top_p
    if top_k > 0:
        keep &= torch.arange(len(sp)) < top_k
    keep &= sp >= min_p * sp[0]
    out = torch.zeros_like(p)
    out[order] = sp * keep
    return out / out.sum()


def hf_reference(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """transformers' warpers in generate's order (sequential: top-p renormalizes after top-k)."""
    ids = torch.zeros(1, 1, dtype=torch.long)
    s = torch.as_tensor(logits, dtype=torch.float64)[None]
    s = TemperatureLogitsWarper(temperature)(ids, s)
    if top_k > 0:
        s = TopKLogitsWarper(top_k)(ids, s)
    if top_p < 1.0:
        s = TopPLogitsWarper(top_p)(ids, s)
    if min_p > 0:
        s = MinPLogitsWarper(min_p)(ids, s)
    return torch.softmax(s, -1)[0]


def plait_probs(logits, **params) -> torch.Tensor:
    reqs = make_reqs(1, **params)
    rows, info = adjusted(torch.tensor([logits], dtype=torch.float32), reqs)
    return sampling_probs(rows, info)[0].double()


def draw_counts(logits, n: int, seed: int = 0, **params) -> torch.Tensor:
    """Counts per token of n draws (n batch rows, the global generator seeded)."""
    reqs = make_reqs(n, **params)
    rows, info = adjusted(torch.tensor([logits], dtype=torch.float32).repeat(n, 1), reqs)
    torch.manual_seed(seed)
    return torch.bincount(sample(rows, [r.sampling for r in reqs], info), minlength=len(logits)).double()


def assert_follows(counts: torch.Tensor, ref: torch.Tensor) -> None:
    """No draw outside the reference's support; a chi-square test (cells expected >= 5, the rest pooled)
    at p = 1e-5 (critical value by Wilson-Hilferty), so a wrong order or off-by-one fails."""
    n = counts.sum()
    assert counts[ref == 0].sum() == 0, f"drew tokens {(counts * (ref == 0)).nonzero().flatten().tolist()}"
    expected = ref * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    df = len(exp) - 1
    if df == 0:
        return
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    z = 4.265  # one-sided normal quantile of 1e-5
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, f"chi2 {chi2:.1f} >= {crit:.1f} (df {df}): counts {obs.tolist()} expected {exp.tolist()}"


CONFIGS = {
    "plain": {},
    "temperature_0.5": {"temperature": 0.5},
    "temperature_2": {"temperature": 2.0},
    "top_k_3": {"top_k": 3},
    "top_k_off": {"top_k": -1},
    "top_k_vocab": {"top_k": V},
    "top_k_past_vocab": {"top_k": 50},
    "top_p_0.8": {"top_p": 0.8},
    "top_p_1": {"top_p": 1.0},
    "top_p_tiny": {"top_p": 1e-3},
    "min_p_0.2": {"min_p": 0.2},
    "min_p_0": {"min_p": 0.0},
    "min_p_1": {"min_p": 1.0},
    "temperature_2_then_top_p": {"temperature": 2.0, "top_p": 0.6},
    "temperature_then_min_p": {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05},
    "top_k_with_top_p_joint": {"temperature": 1.5, "top_k": 4, "top_p": 0.75},
}


@pytest.mark.parametrize("params", CONFIGS.values(), ids=CONFIGS.keys())
def test_sampling_distribution_equals_the_float64_reference(params):
    got = plait_probs(LOGITS, **params)
    want = reference(LOGITS, **params)
    assert torch.allclose(got, want, atol=2e-6), (got, want)
    if not ("top_k" in params and "top_p" in params):
        # Where the semantics are shared, the reference is transformers' own.
        assert torch.allclose(want, hf_reference(LOGITS, **params), atol=1e-12)


@pytest.mark.parametrize("params", CONFIGS.values(), ids=CONFIGS.keys())
def test_draws_follow_the_reference(params):
    assert_follows(draw_counts(LOGITS, 20_000, seed=1, **params), reference(LOGITS, **params))


def test_the_configs_tell_wrong_orders_apart():
    """The reference configs would catch the usual mistakes, each by a wide margin."""

    def tv(a, b):
        return float((a - b).abs().sum() / 2)

    # top-p judged before the temperature (on the untempered distribution)
    nucleus_first = reference(LOGITS, top_p=0.6) > 0
    tempered_after = torch.softmax(torch.tensor(LOGITS, dtype=torch.float64) / 2.0, -1) * nucleus_first
    assert tv(tempered_after / tempered_after.sum(), reference(LOGITS, temperature=2.0, top_p=0.6)) > 0.1
    # top-k off by one
    assert tv(reference(LOGITS, top_k=3), reference(LOGITS, top_k=4)) > 0.05
    # SGLang's joint top-k/top-p vs transformers' and vLLM's renormalize-after-top-k
    joint = CONFIGS["top_k_with_top_p_joint"]
    assert tv(reference(LOGITS, **joint), hf_reference(LOGITS, **joint)) > 0.1


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0}, {"temperature": 1e-5}, {"top_k": 1, "temperature": 1.5}],
    ids=["temperature_0", "temperature_tiny", "top_k_1"],
)
def test_greedy_and_near_greedy_take_the_argmax(params):
    logits = [2.0, 2.001, 1.9, 0.0]  # a near-tie that only the exact argmax resolves
    counts = draw_counts(logits, 2_000, seed=2, **params)
    assert counts.tolist() == [0, 2_000, 0, 0]


# ---------------------------------------------------------------------- regressions (fixed in sampler.py)
def test_top_p_1_row_keeps_its_whole_vocabulary_next_to_a_top_p_row():
    """A top_p = 1 row batched with a top_p < 1 row: float32's cumsum reached 1.0 before the end of a
    49k vocabulary and cut ~2,000 tail tokens of the row that asked for no top-p."""
    gen = torch.Generator().manual_seed(0)
    vocab = 49_152
    rows = torch.randn(2, vocab, generator=gen) * 3  # (2, V)
    reqs = make_reqs(1, vocab=vocab, top_p=1.0) + make_reqs(1, vocab=vocab, top_p=0.5)
    rows, info = adjusted(rows, reqs)
    probs = sampling_probs(rows, info)
    assert bool((probs[0] > 0).all())
    assert torch.allclose(probs[0], torch.softmax(rows[0], -1), rtol=1e-5, atol=0)
    assert int((probs[1] > 0).sum()) < vocab // 10


def test_huge_logit_bias_with_a_small_temperature_picks_the_biased_token():
    """bias 1e38 / temperature 0.01 overflowed to inf; softmax made the row NaN and token 0 came out."""
    counts = draw_counts(LOGITS, 200, seed=3, temperature=0.01, logit_bias={"5": 1e38})
    assert counts[5] == 200


def test_penalties_follow_vllm_order_and_scope():
    """bias, then repetition (prompt + output, divide positive / multiply negative), then frequency
    and presence (output only), computed by hand in float64."""
    logits = [1.0, -1.0, 0.5, 2.0, 3.0, -0.5, 0.2, 0.7]
    prompt, output = (1, 2, 3), (3, 4, 4, 5)
    params = dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={"6": 2.0, "3": -2.5})
    want = torch.tensor(logits, dtype=torch.float64)
    want[6] += 2.0
    want[3] -= 2.5
    for t in set(prompt) | set(output):
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    for t in set(output):
        want[t] -= 0.4 * output.count(t) + 0.3
    reqs = make_reqs(1, prompt=prompt, output=output, vocab=len(logits), **params)
    got, _ = adjusted(torch.tensor([logits]), reqs)
    assert torch.allclose(got[0].double(), want, atol=1e-6), (got, want)


# ---------------------------------------------------------------------- end to end on SmolLM2-135M
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def eng():
    with Engine(num_threads=1, max_total_tokens=8192) as e:
        yield e


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)  # (T, V)


def test_logprobs_are_log_softmax_of_the_raw_logits_like_transformers(eng, hf_default_model, default_tokenizer):
    ids = default_tokenizer(PROMPT)["input_ids"]
    out = eng.generate(
        PROMPT, dict(GREEDY, max_new_tokens=6), return_logprob=True, logprob_start_len=0, top_logprobs_num=5
    )
    meta, n = out["meta_info"], len(ids)
    lp = hf_logprobs(hf_default_model, ids + out["output_ids"])
    assert meta["input_token_logprobs"][0][:2] == (None, ids[0])
    for i, (got, tok, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert tok == ids[i] and got == pytest.approx(lp[i - 1, tok].item(), abs=1e-4)
    for j, ((got, tok, _), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
        want_v, want_i = lp[n - 1 + j].topk(5)
        assert tok == out["output_ids"][j] == want_i[0].item()  # greedy: the top-1
        assert got == pytest.approx(want_v[0].item(), abs=1e-4)
        assert [t for _, t, _ in top] == want_i.tolist()
        assert [v for v, _, _ in top] == pytest.approx(want_v.tolist(), abs=1e-4)
    # Sampled with a temperature and top-k: still the raw model's logprobs (vLLM's raw_logprobs).
    s = eng.generate(PROMPT, {"temperature": 0.5, "top_k": 5, "max_new_tokens": 4, "seed": 3}, return_logprob=True)
    lp = hf_logprobs(hf_default_model, ids + s["output_ids"])
    for j, (got, tok, _) in enumerate(s["meta_info"]["output_token_logprobs"]):
        assert got == pytest.approx(lp[n - 1 + j, tok].item(), abs=1e-4)


def test_repetition_penalty_equals_transformers_generate(eng, hf_default_model, default_tokenizer):
    """Over prompt and output tokens: penalizing the output only would leave the first token " mat"."""
    prompt, penalty = "The cat sat on the mat. The cat sat on the", 1.3
    ids = default_tokenizer(prompt, return_tensors="pt")
    want = hf_default_model.generate(
        **ids, do_sample=False, repetition_penalty=penalty, max_new_tokens=6, min_new_tokens=6
    )[0, ids["input_ids"].shape[1] :].tolist()
    got = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 6, "repetition_penalty": penalty})
    assert got["output_ids"] == want[: len(got["output_ids"])]


def test_first_token_draws_follow_the_reference_from_transformers_logits(eng, hf_default_model, default_tokenizer):
    prompt, params, n = "My favourite colour is", {"temperature": 1.3, "top_k": 12, "top_p": 0.9}, 240
    ids = default_tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0, -1].double()
    outs = eng.generate(prompt, dict(params, max_new_tokens=1, n=n, seed=1000))
    toks = torch.tensor([o["output_ids"][0] for o in outs])
    assert_follows(torch.bincount(toks, minlength=len(logits)).double(), reference(logits, **params))


def test_stops_and_finish_reasons_as_sglang_reports_them(eng):
    ref = eng.generate(PROMPT, GREEDY)
    text, ids = ref["text"], ref["output_ids"]
    assert ref["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert "s.\n\n" in text and text.startswith(" Paris")  # the cases below are written for this output

    def run(**params):
        o = eng.generate(PROMPT, dict(GREEDY, **params))
        return o["text"], o["meta_info"]["finish_reason"]

    # a stop string split across tokens (" Paris" "." "\n"), trimmed; kept up to its end with no_stop_trim
    assert run(stop="s.\n") == (" Pari", {"type": "stop", "matched": "s.\n"})
    assert run(stop="s.\n", no_stop_trim=True) == (" Paris.\n", {"type": "stop", "matched": "s.\n"})
    # several stops: the first to appear in the text wins, whatever the list order
    for stops in (["answer", "\n\n"], ["\n\n", "answer"]):
        assert run(stop=stops) == (" Paris.", {"type": "stop", "matched": "\n\n"})
    # inside the first token, and the whole first token
    assert run(stop="ari") == (" P", {"type": "stop", "matched": "ari"})
    assert run(stop=" Paris") == ("", {"type": "stop", "matched": " Paris"})
    # stop_token_ids: the id stays in output_ids, its text is trimmed unless no_stop_trim
    nl = ids[2]
    o = eng.generate(PROMPT, dict(GREEDY, stop_token_ids=[nl]))
    assert o["output_ids"] == ids[:3] and o["text"] == " Paris."
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": nl}
    assert run(stop_token_ids=[nl], no_stop_trim=True)[0] == " Paris.\n"
    # min_new_tokens holds the stop id back until reached
    o = eng.generate(PROMPT, dict(GREEDY, stop_token_ids=[nl], min_new_tokens=6))
    assert nl not in o["output_ids"][:6]


def test_ignore_eos_and_skip_special_tokens(eng, default_tokenizer):
    prompt = "Write a long story about a dragon."  # the raw model ends this at once
    eos = default_tokenizer.eos_token_id
    o = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 4})
    assert o["output_ids"] == [eos] and o["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    o = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    assert o["output_ids"][0] == eos and o["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert default_tokenizer.eos_token not in o["text"]
    raw = eng.generate(
        prompt, {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True, "skip_special_tokens": False}
    )
    assert raw["text"].startswith(default_tokenizer.eos_token)


def test_n_samples_with_a_seed_differ_and_reproduce_batched_alone_and_without_radix_cache(eng):
    sp = {"temperature": 1.0, "max_new_tokens": 5, "n": 3, "seed": 42}
    first = [o["output_ids"] for o in eng.generate(PROMPT, sp)]
    assert len({tuple(x) for x in first}) == 3
    assert [o["output_ids"] for o in eng.generate(PROMPT, sp)] == first
    batch = eng.generate([PROMPT, "Hello there"], [sp, {"temperature": 0.9, "max_new_tokens": 5}])
    assert [o["output_ids"] for o in batch[:3]] == first
    # sample i takes seed + i: alone with that seed it is the same output
    assert eng.generate(PROMPT, dict(sp, n=1, seed=43))["output_ids"] == first[1]
    with Engine(num_threads=1, max_total_tokens=4096, disable_radix_cache=True) as no_cache:
        assert [o["output_ids"] for o in no_cache.generate(PROMPT, sp)] == first
