"""RequestOptions, expand_samples and SamplingParams' immutability: the request-building side's one spelling
of each concept, and a request's output as a stream hands it out (deltas) and as SGLang's API promises it
(cumulative) (no engine: these are plain objects)."""

import dataclasses
import pickle
import time

import pytest
from plait.runtime import SamplingParams, ServerArgs
from plait.runtime.engine.request_builder import OPTION_DEFAULTS, build_requests
from plait.runtime.engine.request_state import RequestState
from plait.runtime.engine.streams import CumulativeOutput
from plait.runtime.engine.tokenizer_manager import TokenizerManager
from plait.runtime.io_struct import ReqOutput, SchedulerInfo, TokenizedGenerateReq
from plait.runtime.request import Req
from plait.runtime.request_options import RequestOptionError, RequestOptions, expand_samples, is_sample_of, sample_rid


def test_of_maps_sglang_defaults_and_truthy_flags():
    opts = RequestOptions.of(
        rid="r", return_logprob=1, logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=None
    )
    assert opts == RequestOptions(
        rid="r", return_logprob=True, logprob_start_len=-1, top_logprobs_num=0, return_text_in_logprobs=False
    )


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"top_logprobs_num": -1}, "top_logprobs_num", "top_logprobs_num must be an int >= 0, got -1"),
        ({"top_logprobs_num": 2.5}, "top_logprobs_num", "top_logprobs_num must be an int >= 0, got 2.5"),
        ({"logprob_start_len": -2}, "logprob_start_len", "logprob_start_len must be an int >= -1, got -2"),
        ({"logprob_start_len": "0"}, "logprob_start_len", "logprob_start_len must be an int >= -1, got '0'"),
        ({"rid": 7}, "rid", "rid must be a string"),
    ],
)
def test_a_bad_option_is_a_value_error_naming_its_field(fields, field, message):
    with pytest.raises(RequestOptionError) as info:
        RequestOptions.of(**fields)
    assert isinstance(info.value, ValueError) and info.value.field == field and message in str(info.value)
    with pytest.raises(RequestOptionError):  # checked however the object is built
        RequestOptions(**fields)


def test_options_are_frozen_and_prompt_checks_need_the_length():
    opts = RequestOptions.of(rid="r", return_logprob=True, logprob_start_len=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.rid = "other"  # type: ignore[misc]
    opts.check_prompt(4)
    with pytest.raises(ValueError, match=r"logprob_start_len \(3\) must be less than the prompt's 3 tokens"):
        opts.check_prompt(3)
    RequestOptions.of(logprob_start_len=3).check_prompt(3)  # no logprobs asked: nothing to refuse


def test_n_equal_one_is_the_request_itself():
    sp, opts = SamplingParams(seed=5), RequestOptions(rid="r")
    assert expand_samples(sp, opts) == [(sp, opts)]
    assert expand_samples(sp, opts)[0][0] is sp


def test_samples_get_rid_dash_k_seed_plus_k_n_one_and_the_group():
    sp = SamplingParams(n=3, seed=10, temperature=0.7)
    samples = expand_samples(sp, RequestOptions(rid="q", return_logprob=True))
    assert [o.rid for _, o in samples] == ["q-0", "q-1", "q-2"] == [sample_rid("q", k) for k in range(3)]
    assert [s.seed for s, _ in samples] == [10, 11, 12]
    assert all(s.n == 1 and s.temperature == 0.7 for s, _ in samples)
    assert all(o.group == "q" and o.return_logprob for _, o in samples)  # grouped under the request
    named = expand_samples(sp, RequestOptions(rid="q", group="program"))
    assert {o.group for _, o in named} == {"program"}
    unseeded = expand_samples(SamplingParams(n=2), RequestOptions(rid="u"))
    assert [s.seed for s, _ in unseeded] == [None, None]
    assert sp.n == 3 and sp.seed == 10  # the request's own parameters are untouched
    assert all(is_sample_of(o.rid, "q") for _, o in samples) and not is_sample_of("q", "q")
    with pytest.raises(ValueError, match="rid"):
        expand_samples(sp, RequestOptions())


def test_the_scheduler_message_carries_the_options_whole_and_the_req_is_built_from_it():
    opts = RequestOptions.of(
        rid="m",
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
        stream=True,
        group="g",
    )
    msg = TokenizedGenerateReq([1, 2], SamplingParams(), opts)
    assert msg.options is opts and msg.rid == "m"
    wire = pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))  # as over ZMQ
    assert wire == msg and wire.options == opts and pickle.loads(pickle.dumps(opts)) == opts
    req = Req.of(wire, None, (0,))
    assert req.options is wire.options and req.origin_input_ids is wire.input_ids  # taken over, not copied
    assert (
        req.rid,
        req.return_logprob,
        req.logprob_start_len,
        req.top_logprobs_num,
        req.return_text_in_logprobs,
        req.stream,
        req.group,
    ) == ("m", True, 0, 2, True, True, "g")
    plain = Req("p", [1, 2, 3], SamplingParams())  # no options: nothing asked besides the tokens
    assert (plain.return_logprob, plain.logprob_start_len, plain.stream, plain.group) == (False, 3, False, None)


def test_sampling_params_are_immutable_and_from_dict_shares_an_instance():
    sp = SamplingParams.from_dict({"temperature": 0.5, "seed": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.seed = 2  # type: ignore[misc]
    assert SamplingParams.from_dict(sp) is sp
    assert "_verified_for_vocab" not in sp.to_dict() and "_verified_for_vocab" not in SamplingParams.field_names()


def test_a_verified_sampling_params_is_not_verified_again(monkeypatch):
    sp = SamplingParams(n=2, seed=3, stop_token_ids=[5])
    calls = []
    real = SamplingParams._check
    monkeypatch.setattr(SamplingParams, "_check", lambda self, vocab: calls.append(vocab) or real(self, vocab))
    sp.verify(100)
    sp.verify(100)
    sample = sp.for_sample(1)
    sample.verify(100)  # a sample of a verified request: its seed range was checked for all n
    assert calls == [100]
    sp.verify(6)  # another vocabulary is another check (token ids are checked against it) ...
    assert calls == [100, 6]
    dataclasses.replace(sp, max_new_tokens=9).verify(6)  # ... and so is a changed copy
    assert calls == [100, 6, 6]
    assert sp == SamplingParams(n=2, seed=3, stop_token_ids=[5])  # the memo is not part of the value


def test_a_failed_verify_is_not_remembered():
    sp = SamplingParams(stop_token_ids=[50])
    for _ in range(2):
        with pytest.raises(ValueError, match="stop_token_ids must lie in"):
            sp.verify(10)


# ---------------------------------------------------------------- the Engine's request building (no engine)


class _Manager:
    """What build_requests uses of a TokenizerManager (its real validate), without sockets or a scheduler."""

    info = SchedulerInfo(
        max_total_tokens=4096,
        context_len=512,
        vocab_size=300,
        max_running_requests=8,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        eos_token_ids=[0],
    )
    server_args = ServerArgs()
    validate = TokenizerManager.validate

    def tokenize(self, text):
        return [ord(c) for c in text]


def build(prompt=None, sampling_params=None, input_ids=None, options=None, **option_args):
    return build_requests(_Manager(), prompt, sampling_params, input_ids, {**OPTION_DEFAULTS, **option_args}, options)


def test_engine_requests_expand_n_like_the_server():
    (prompt,), batch = build(
        "hi", {"n": 2, "seed": 4, "max_new_tokens": 3}, rid="g", return_logprob=True, top_logprobs_num=2
    )
    assert not batch
    members = prompt.samples
    assert [(m.rid, m.sampling_params.seed, m.sampling_params.n, m.options.group) for m in members] == [
        ("g-0", 4, 1, "g"),
        ("g-1", 5, 1, "g"),
    ]
    assert all(
        m.options.return_logprob and m.options.top_logprobs_num == 2 and m.options.logprob_start_len == -1
        for m in members
    )
    (one,), _ = build("hi", {"max_new_tokens": 3})
    assert len(one.samples) == 1 and len(one.samples[0].rid) == 32  # a fresh rid ...
    assert one.samples[0].options.group is None and one.grammar_warnings == []  # ... no group, nothing to warn of


def test_a_prompts_warnings_go_with_its_requests_not_into_the_scheduler_message():
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    (prompt,), _ = build(input_ids=[5, 6], sampling_params={"json_schema": schema, "max_new_tokens": 8, "n": 2})
    assert len(prompt.samples) == 2 and any("uniqueItems" in w for w in prompt.grammar_warnings)
    # The message is the prompt (its ids and a vision model's images), its sampling and its options: no warnings.
    fields = {f.name for f in dataclasses.fields(TokenizedGenerateReq)}
    assert fields == {"input_ids", "images", "sampling_params", "options"}


def test_engine_batch_options_per_item_and_batch_rids():
    groups, batch = build(
        ["ab", "cd"],
        {"max_new_tokens": 1},
        rid="b",
        return_logprob=[True, False],
        logprob_start_len=[0, None],
        group="prog",
    )
    assert batch and [g.samples[0].rid for g in groups] == ["b_0", "b_1"]
    options = [g.samples[0].options for g in groups]
    assert [(o.return_logprob, o.logprob_start_len, o.group) for o in options] == [
        (True, 0, "prog"),
        (False, -1, "prog"),
    ]
    with pytest.raises(ValueError, match=r"batch item 1: top_logprobs_num must be an int >= 0, got -1"):
        build(["ab", "cd"], {"max_new_tokens": 1}, top_logprobs_num=[1, -1])
    with pytest.raises(ValueError, match=r"logprob_start_len \(2\) must be less than the prompt's 2 tokens"):
        build("ab", {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=2)


def test_engine_takes_one_options_object_instead_of_the_keywords(monkeypatch):
    checks = []
    real = SamplingParams._check
    monkeypatch.setattr(SamplingParams, "_check", lambda self, vocab: checks.append(vocab) or real(self, vocab))
    sp = SamplingParams(max_new_tokens=2, n=2, seed=1)
    sp.verify(300)  # as the HTTP server does (native_api.verified_sampling_params) before it calls the Engine
    (prompt,), _ = build(input_ids=[5, 6], sampling_params=sp, options=RequestOptions(rid="o", stream=True))
    assert [(m.rid, m.options.stream) for m in prompt.samples] == [("o-0", True), ("o-1", True)]
    assert checks == [300]  # the Engine did not verify it again
    with pytest.raises(ValueError, match="options replaces return_logprob, rid: give one or the other"):
        build(input_ids=[5, 6], sampling_params=sp, options=RequestOptions(rid="o"), return_logprob=True, rid="x")


# ---------------------------------------------------------------- a request's output: deltas, folded


def test_a_stream_is_deltas_that_fold_into_the_whole_result():
    st = RequestState("r", 3, True, time.monotonic())
    st.apply(ReqOutput("r", [5, 6], "Hello wor", None, 3, 2, 0, [(None, 1, None)], [None], [(-0.1, 5, None)] * 2))
    first = st.delta()
    assert (first["text"], first["text_offset"], first["output_ids"]) == ("Hello wor", 0, [5, 6])
    assert first["meta_info"]["input_token_logprobs"] == [(None, 1, None)]
    assert first["meta_info"]["output_token_logprobs"] == [(-0.1, 5, None)] * 2
    assert first["meta_info"]["completion_tokens"] == 2 and first["meta_info"]["finish_reason"] is None
    # the end: a stop regex matched inside what was already sent, so the final text is shorter
    stop = {"type": "stop", "matched": "wor"}
    st.apply(ReqOutput("r", [7], "ld", stop, 3, 3, 0, output_token_logprobs=[(-0.3, 7, None)], final_text="Hello "))
    last = st.delta()
    assert (last["text"], last["text_offset"], last["output_ids"]) == ("", 6, [7])
    assert last["meta_info"]["input_token_logprobs"] == [] and last["meta_info"]["output_token_logprobs"] == [
        (-0.3, 7, None)
    ]
    total = CumulativeOutput()
    for delta in (first, last):
        total.add(delta)
    folded, whole = total.chunk(), st.result()
    for out in (folded, whole):
        out["meta_info"].pop("e2e_latency")
    assert folded == whole and whole["text"] == "Hello " and whole["output_ids"] == [5, 6, 7]
    kept = total.chunk()
    total.add({"text": "!", "output_ids": [8], "meta_info": {"output_token_logprobs": [(-1.0, 8, None)]}})
    assert kept["output_ids"] == [5, 6, 7] and len(kept["meta_info"]["output_token_logprobs"]) == 3  # a copy
