"""Choice methods on fixed logprobs, select's token-healing bookkeeping, and gen parameter resolution."""

import dataclasses
import math

import plait
import pytest
from plait.backend.native import NO_OPTIONS, PREFILL_ONLY, SCORE_ONLY, choice_token_logprobs, mean_logprob
from plait.backend.runtime_endpoint import generate_body, sampling_body
from plait.choices import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized
from plait.gen_params import RunDefaults, resolve_gen
from plait.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from plait.runtime.request_options import RequestOptions


def lp(*values):
    return [(v, 100 + i, f"t{i}") for i, v in enumerate(values)]


CHOICES = ["short", "longer one", "mid"]
INPUT = [lp(-1.0), lp(-0.5, -0.5, -2.9), lp(-0.8, -1.0)]
NORMALIZED = [mean_logprob(x) for x in INPUT]


def call(method, unconditional=None):
    return method(
        choices=CHOICES,
        normalized_prompt_logprobs=NORMALIZED,
        input_token_logprobs=INPUT,
        output_token_logprobs=[[], [], []],
        unconditional_token_logprobs=unconditional,
    )


def test_token_length_normalized_picks_best_mean():
    # means: -1.0, -1.3, -0.9
    d = call(token_length_normalized)
    assert d.decision == "mid"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -1.3, -0.9])
    assert d.meta_info["input_token_logprobs"] is INPUT


def test_greedy_token_selection_decides_on_first_differing_token():
    # token 0: -1.0, -0.5, -0.8 -> "longer one" wins at once although its mean is worst
    d = call(greedy_token_selection)
    assert d.decision == "longer one"
    m = d.meta_info["greedy_logprob_matrix"]
    assert m[0] == pytest.approx([-1.0, -1.0, -1.0])  # padded with its own mean
    assert m[2] == pytest.approx([-0.8, -1.0, -0.9])


def test_greedy_token_selection_tie_breaks_on_later_tokens():
    inputs = [lp(-0.5, -3.0), lp(-0.5, -0.1), lp(-2.0)]
    d = greedy_token_selection(
        choices=["a", "b", "c"],
        normalized_prompt_logprobs=[0, 0, 0],
        input_token_logprobs=inputs,
        output_token_logprobs=[[], [], []],
    )
    assert d.decision == "b"


def test_unconditional_likelihood_normalized_discounts_common_choices():
    # conditional means favour "longer one" only after subtracting how likely each is unprompted
    unconditional = [
        [(None, 1, "a")],
        [(None, 1, "a"), (-0.1, 2, "b"), (-0.2, 3, "c")],
        [(None, 1, "a"), (-3.0, 2, "b")],
    ]
    d = call(unconditional_likelihood_normalized, unconditional)
    scores = d.meta_info["normalized_unconditional_prompt_logprobs"]
    # short: -1.0 ; longer: (-0.5 + -0.4 + -2.7)/3 = -1.2 ; mid: (-0.8 + 2.0)/2 = 0.6
    assert scores == pytest.approx([-1.0, -1.2, 0.6])
    assert d.decision == "mid"
    with pytest.raises(ValueError, match="unconditional"):
        call(unconditional_likelihood_normalized, None)
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs
    assert not token_length_normalized.requires_unconditional_logprobs


def test_ties_go_to_the_first_choice():
    d = token_length_normalized(
        choices=["a", "b"],
        normalized_prompt_logprobs=[-1.0, -1.0],
        input_token_logprobs=[lp(-1.0), lp(-1.0)],
        output_token_logprobs=[[], []],
    )
    assert d.decision == "a"


def test_choice_token_logprobs_drops_the_unmerged_prefix_token():
    # prefix "A:" is 2 tokens; prefix+" yes" is 3 tokens; entries from logprob_start_len=0
    meta = {"prompt_tokens": 3, "input_token_logprobs": [(None, 1, "A"), (-0.2, 2, ":"), (-0.7, 3, " yes")]}
    assert choice_token_logprobs(meta, "A:", 2) == [(-0.7, 3, " yes")]


def test_choice_token_logprobs_keeps_a_healed_token():
    # prefix "A: " ends in a space token; with the choice the space merged into " yes"
    meta = {"prompt_tokens": 3, "input_token_logprobs": [(-0.3, 2, ":"), (-0.9, 7, " yes")]}
    out = choice_token_logprobs(meta, "A: ", 3)
    assert out == [(-0.9, 7, " yes")]  # position 2 onward; ":" is not where the choice starts
    meta = {"prompt_tokens": 3, "input_token_logprobs": [(-0.3, 2, "A:"), (-0.9, 7, " yes"), (-0.1, 8, "!")]}
    assert choice_token_logprobs(meta, "A: ", 2) == [(-0.9, 7, " yes"), (-0.1, 8, "!")]


def test_choice_token_logprobs_needs_enough_entries():
    with pytest.raises(RuntimeError, match="input logprobs"):
        choice_token_logprobs({"prompt_tokens": 10, "input_token_logprobs": [(-1.0, 1, "x")]}, "abc", 5)


def test_mean_logprob_skips_none_only():
    assert mean_logprob([(None, 1, "a"), (0.0, 2, "b"), (-1.0, 3, "c")]) == -0.5
    assert math.isinf(mean_logprob([]))


# ---- gen parameters ----


def test_gen_inherits_run_defaults_and_overrides_by_name():
    defaults = RunDefaults.from_kwargs({"max_new_tokens": 50, "temperature": 0.0, "top_p": 0.9})
    r = resolve_gen(defaults, plait.gen("a", max_tokens=7, stop="\n").overrides)
    assert r.sampling.max_new_tokens == 7
    assert r.sampling.temperature == 0.0 and r.sampling.top_p == 0.9
    assert r.sampling.stop == ["\n"]
    r = resolve_gen(RunDefaults(), plait.gen("a").overrides)
    assert r.sampling.max_new_tokens == 128 and r.sampling.temperature == 1.0


def test_dtype_maps_to_regex_and_stops_and_chat_stop_is_added():
    r = resolve_gen(RunDefaults(), plait.gen_int("n").overrides, chat_stop=("<|im_end|>",))
    assert r.sampling.regex == REGEX_INT
    assert r.sampling.stop == [" ", "\n", "<|im_end|>"]
    assert resolve_gen(RunDefaults(), plait.gen("f", dtype=float).overrides).sampling.regex == REGEX_FLOAT
    assert resolve_gen(RunDefaults(), plait.gen("b", dtype="bool").overrides).sampling.regex == REGEX_BOOL
    assert resolve_gen(RunDefaults(), plait.gen_string("s").overrides).sampling.regex == REGEX_STR
    with pytest.raises(ValueError, match="invalid dtype"):
        plait.gen("x", dtype=list)


def test_request_dict_sends_only_what_differs_from_defaults():
    r = resolve_gen(RunDefaults(), plait.gen("a", max_tokens=5, top_k=3, return_logprob=True).overrides)
    assert sampling_body(r.sampling) == {"max_new_tokens": 5, "temperature": 1.0, "top_k": 3}
    assert r.options == RequestOptions(return_logprob=True)
    body = generate_body("Q: ", r.sampling, dataclasses.replace(r.options, group="p"))
    assert body == {"text": "Q: ", "sampling_params": sampling_body(r.sampling), "return_logprob": True, "group": "p"}
    # what SGLang's frontend sends for a prefill and for select's scoring
    assert generate_body([[1, 2]], PREFILL_ONLY, NO_OPTIONS) == {
        "input_ids": [[1, 2]],
        "sampling_params": {"max_new_tokens": 0},
    }
    assert sampling_body(SCORE_ONLY) == {"max_new_tokens": 0, "temperature": 0}


def test_bad_sampling_values_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        resolve_gen(RunDefaults(), plait.gen("a", temperature=-1).overrides)
    with pytest.raises(ValueError, match="regex"):
        plait.gen("a", regex="(unclosed")
    with pytest.raises(TypeError, match="unknown sampling argument"):
        RunDefaults.from_kwargs({"temprature": 0})
    with pytest.raises(ValueError, match="choices"):
        plait.select("x", choices=[])
    with pytest.raises(TypeError, match="fixes the output format"):
        plait.gen_int("x", regex="[0-9]")


def test_gen_with_choices_is_select():
    e = plait.gen("c", choices=["a", "b"])
    assert isinstance(e, plait.ir.SglSelect) and e.temperature == 0.0
    assert e.choices_method is token_length_normalized
