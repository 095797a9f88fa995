"""SamplingParams validation and the batched sampler on fixed logits (no model).

Requests are real `Req` objects built directly; logits are small hand-made tensors whose expected
outcome can be worked out on paper.
"""

import math

import pytest
import torch
from plait.runtime.executor.sampler import SamplingBatchInfo, apply_logit_adjustments, sample
from plait.runtime.request import Req
from plait.runtime.sampling_params import SamplingParams

VOCAB = 8
EOS = 7


def make_req(prompt=(1, 2), output=(), eos=(EOS,), **params) -> Req:
    sp = SamplingParams.from_dict(params)
    sp.verify(VOCAB)
    r = Req("r", list(prompt), sp, eos_token_ids=tuple(eos))
    r.output_ids[:] = list(output)
    if sp.seed is not None:  # as the scheduler does
        r.set_generator(torch.Generator().manual_seed(sp.seed))
    return r


def adjusted(logits, reqs):
    """Logits after bias / penalties / min_new_tokens bans, as the model runner applies them."""
    logits = torch.as_tensor(logits, dtype=torch.float32).clone()
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    info = SamplingBatchInfo.from_rows([r.sampling for r in reqs], VOCAB, "cpu")
    apply_logit_adjustments(logits, [r.sampling for r in reqs], info)
    return logits, info


def draw(logits, reqs):
    logits, info = adjusted(logits, reqs)
    return sample(logits, [r.sampling for r in reqs], info)


def empirical(logits, n=400, **params) -> set[int]:
    """Set of tokens drawn in n seeded batch rows with these parameters."""
    reqs = [make_req(seed=i, **params) for i in range(n)]
    rows = torch.as_tensor(logits, dtype=torch.float32).repeat(n, 1)
    return set(draw(rows, reqs).tolist())


def log_probs(p):
    return torch.log(torch.tensor(p, dtype=torch.float32))


# ---------------------------------------------------------------------- SamplingParams
def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "max_new_tokens": 4})
    with pytest.raises(ValueError, match="sampling_params must be a dict"):
        SamplingParams.from_dict([("temperature", 0)])


def test_from_dict_converts_json_friendly_values():
    sp = SamplingParams.from_dict({"logit_bias": {"5": 2}, "json_schema": {"type": "object"}})
    assert sp.logit_bias == {5: 2.0}
    assert sp.json_schema == '{"type": "object"}'


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -2}, "min_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"seed": "abc"}, "seed"),
        ({"regex": "a+", "json_schema": '{"type": "string"}'}, "mutually exclusive"),
        ({"stop_regex": "(unclosed"}, "stop_regex"),
        ({"stop_token_ids": [3, VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop": ""}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"stop_regex": 5}, "stop_regex"),
        ({"logit_bias": {VOCAB + 1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"logit_bias": {1: 1e308}}, "logit_bias"),  # finite, but infinite once added to float32 logits
        ({"seed": 10**23}, "seed"),  # past a 64-bit generator seed: it used to crash the scheduler
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64 - 1, "n": 2}, "seed"),  # the second sample's seed would overflow
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_verify_rejects_out_of_range_values_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params).verify(VOCAB)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ],
)
def test_from_dict_rejects_malformed_logit_bias(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params).verify(VOCAB)


def test_verify_accepts_the_documented_ranges():
    SamplingParams.from_dict(
        {
            "max_new_tokens": 0,
            "temperature": 0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 1.0,
            "n": 4,
            "frequency_penalty": -2,
            "presence_penalty": 2,
            "repetition_penalty": 2.0,
            "seed": 3,
            "stop": ["a", "b"],
            "stop_token_ids": [0, VOCAB - 1],
            "stop_regex": r"\d+",
            "logit_bias": {0: -5},
        }
    ).verify(VOCAB)


# ---------------------------------------------------------------------- greedy / filters
def test_greedy_takes_the_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 0.1]])
    reqs = [make_req(temperature=0), make_req(temperature=0)]
    assert draw(logits, reqs).tolist() == [1, 0]


def test_greedy_row_stays_argmax_inside_a_sampled_batch():
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 1.0  # argmax; sampling from a nearly flat row rarely picks it
    reqs = [make_req(temperature=0), make_req(temperature=1.0, seed=0)]
    for _ in range(20):
        assert draw(logits, reqs)[0].item() == 4


def test_top_k_1_equals_greedy():
    logits = torch.tensor([0.5, 0.4, 2.0, 1.9, 0.0, 0.0, 0.0, 0.0])
    assert empirical(logits, temperature=1.0, top_k=1) == {2}


def test_top_k_keeps_the_k_most_likely():
    logits = log_probs([0.05, 0.3, 0.05, 0.25, 0.2, 0.05, 0.05, 0.05])
    assert empirical(logits, temperature=1.0, top_k=3) == {1, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.4, 0.25, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0]
    logits = log_probs(probs)
    # 0.4 + 0.25 = 0.65 < 0.7, so the third token is needed to reach 0.7, and no more.
    assert empirical(logits, temperature=1.0, top_p=0.7) == {0, 1, 2}
    # 0.4 alone does not reach 0.5: two tokens.
    assert empirical(logits, temperature=1.0, top_p=0.5) == {0, 1}
    # The most likely token always stays.
    assert empirical(logits, temperature=1.0, top_p=0.01) == {0}


def test_min_p_drops_tokens_below_min_p_times_the_max():
    logits = log_probs([0.4, 0.21, 0.19, 0.1, 0.05, 0.05, 0.0, 0.0])
    # min_p 0.5: threshold 0.2 → tokens with p >= 0.2 survive.
    assert empirical(logits, temperature=1.0, min_p=0.5) == {0, 1}


def test_temperature_scales_before_filtering():
    # At temperature 0.05 token 0 holds ~0.99 of the mass, so top_p 0.9 keeps only it.
    logits = log_probs([0.4, 0.3, 0.3, 0, 0, 0, 0, 0])
    assert empirical(logits, temperature=0.05, top_p=0.9) == {0}
    assert empirical(logits, temperature=1.0, top_p=0.9) == {0, 1, 2}


# ---------------------------------------------------------------------- adjustments
def test_frequency_and_presence_penalties_change_exactly_the_seen_output_tokens():
    base = torch.arange(VOCAB, dtype=torch.float32)
    r = make_req(prompt=(0, 1), output=(3, 3, 5), frequency_penalty=0.5, presence_penalty=0.25)
    out, _ = adjusted(base, [r])
    expected = base.clone()
    expected[3] -= 2 * 0.5 + 0.25  # seen twice
    expected[5] -= 1 * 0.5 + 0.25  # seen once
    # Prompt tokens (0, 1) are not penalized by frequency/presence (OpenAI semantics).
    assert torch.allclose(out[0], expected)


def test_negative_frequency_penalty_rewards_repeats():
    base = torch.zeros(VOCAB)
    r = make_req(output=(2, 2, 2), frequency_penalty=-1.0)
    out, _ = adjusted(base, [r])
    assert out[0, 2].item() == pytest.approx(3.0)
    assert torch.count_nonzero(out[0]).item() == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    base = torch.tensor([2.0, -2.0, 4.0, -1.0, 3.0, 1.0, 0.5, 0.0])
    r = make_req(prompt=(0, 1), output=(2,), repetition_penalty=2.0)
    out, _ = adjusted(base, [r])
    expected = base.clone()
    expected[0] = 1.0  # prompt token, positive: divided
    expected[1] = -4.0  # prompt token, negative: multiplied
    expected[2] = 2.0  # output token
    assert torch.allclose(out[0], expected)


def test_penalties_are_per_row():
    base = torch.zeros(2, VOCAB)
    reqs = [make_req(output=(4,), frequency_penalty=1.0), make_req(output=(4,))]
    out, _ = adjusted(base, reqs)
    assert out[0, 4].item() == -1.0
    assert torch.count_nonzero(out[1]).item() == 0


def test_logit_bias_adds_to_the_named_tokens():
    base = torch.zeros(VOCAB)
    r = make_req(logit_bias={"6": 100.0, "1": -3.0})
    out, _ = adjusted(base, [r])
    assert out[0, 6].item() == 100.0 and out[0, 1].item() == -3.0
    assert torch.count_nonzero(out[0]).item() == 2
    assert empirical(base, temperature=1.0, logit_bias={6: 100.0}) == {6}


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached():
    base = torch.zeros(VOCAB)
    base[EOS] = 10.0
    base[5] = 9.0
    base[2] = 1.0
    r = make_req(output=(2,), min_new_tokens=3, stop_token_ids=[5], temperature=0)
    out, _ = adjusted(base, [r])
    assert out[0, EOS].item() == -math.inf and out[0, 5].item() == -math.inf
    assert draw(base, [r]).item() == 2
    r.output_ids[:] = [2, 2, 2]  # reached: no more bans
    assert draw(base, [r]).item() == EOS


def test_min_new_tokens_with_ignore_eos_leaves_eos_alone():
    base = torch.zeros(VOCAB)
    base[EOS] = 10.0
    r = make_req(output=(), min_new_tokens=2, ignore_eos=True, temperature=0)
    # ignore_eos: EOS is not a stop token, so nothing is banned and EOS is simply a token.
    assert draw(base, [r]).item() == EOS


# ---------------------------------------------------------------------- seeds
def _seeded_draws(seed, steps=30):
    logits = torch.zeros(1, VOCAB)  # uniform: every draw depends on the generator
    r = make_req(temperature=1.0, seed=seed)
    return [draw(logits, [r]).item() for _ in range(steps)]


def test_seeded_generators_reproduce_draws():
    assert _seeded_draws(1234) == _seeded_draws(1234)
    assert _seeded_draws(1234) != _seeded_draws(4321)


def test_seeded_row_is_independent_of_its_batch_neighbours():
    logits = torch.zeros(1, VOCAB)
    alone = make_req(temperature=1.0, seed=7)
    expected = [draw(logits, [alone]).item() for _ in range(10)]
    seeded = make_req(temperature=1.0, seed=7)
    neighbour = make_req(temperature=0.7, top_k=3)  # unseeded: uses the global generator
    got = [draw(logits.repeat(2, 1), [neighbour, seeded])[1].item() for _ in range(10)]
    assert got == expected


def test_draws_are_the_tokens_torch_multinomial_gives_for_the_same_random_numbers():
    # The sampler draws argmax(p / q), q ~ Exp(1), without torch.multinomial's host-side check (a device
    # sync): for the same generator state it must pick exactly multinomial's tokens, seeded or not.
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    reqs = [make_req(temperature=0.8) for _ in range(6)]
    probs = torch.softmax(logits / 0.8, dim=-1)
    torch.manual_seed(11)
    expected = torch.multinomial(probs, 1).squeeze(1)
    torch.manual_seed(11)
    assert torch.equal(draw(logits, reqs), expected)
    seeded = [make_req(temperature=0.8, seed=100 + i) for i in range(6)]
    expected = [
        torch.multinomial(probs[i], 1, generator=torch.Generator().manual_seed(100 + i)).item() for i in range(6)
    ]
    assert draw(logits, seeded).tolist() == expected


def test_batch_parameters_come_from_one_upload_with_exact_values():
    reqs = [
        make_req(temperature=0.5, top_k=3, top_p=0.9, min_p=0.05),
        make_req(temperature=0.0),
        make_req(temperature=1.3, top_k=-1),
    ]
    info = SamplingBatchInfo.from_rows([r.sampling for r in reqs], VOCAB, "cpu")
    assert info.temperatures.shape == (3, 1) and info.temperatures[:, 0].tolist() == [0.5, 1.0, pytest.approx(1.3)]
    assert info.top_ks.dtype == torch.int64 and info.top_ks.tolist() == [3, VOCAB, VOCAB]
    assert info.greedy.dtype == torch.bool and info.greedy.tolist() == [False, True, False]
    assert info.top_ps.tolist() == [pytest.approx(0.9), 1.0, 1.0] and info.min_ps[0].item() == pytest.approx(0.05)
