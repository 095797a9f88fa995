"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer (byte-level BPE).

Byte-level BPE splits one emoji or CJK character over several tokens; decoding a partial character
yields U+FFFD. The detokenizer must hold such text back and never emit it.
"""

import pytest
from plait.runtime.detokenizer import IncrementalDetokenizer, find_stop_regex, find_stop_string
from plait.runtime.request import FinishReason, Req
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.outputs import OutputBuilder

MULTIBYTE_TEXTS = [
    "Café naïve — 日本語のテキスト 🚀🎉 emoji 👩‍👩‍👧 done. Ünïcödé ✓ 中文",
    "🙂🙃😉 three emoji in a row, then Ελληνικά and русский текст.",
    "  leading spaces\n\tand a tab, then 한국어 and ok 👍🏽 (skin tone)",
]
CONTEXT_LEN = 10_000


def stream_deltas(tokenizer, ids, chunk=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_token_by_token_never_yields_replacement_chars(default_tokenizer, text):
    ids = default_tokenizer.encode(text)
    # The text really is split mid-character somewhere (else this test would prove nothing).
    assert any("\ufffd" in default_tokenizer.decode([t]) for t in ids)
    detok, deltas = stream_deltas(default_tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == default_tokenizer.decode(ids) == text
    assert detok.text == text


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_multi_token_steps_concatenate_to_the_full_decode(default_tokenizer, chunk):
    text = MULTIBYTE_TEXTS[0]
    ids = default_tokenizer.encode(text)
    _, deltas = stream_deltas(default_tokenizer, ids, chunk=chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text


def test_emitted_text_is_always_a_prefix_of_the_final_text(default_tokenizer):
    text = MULTIBYTE_TEXTS[1]
    ids = default_tokenizer.encode(text)
    detok = IncrementalDetokenizer(default_tokenizer)
    for t in ids:
        detok.step([t])
        assert text.startswith(detok.text)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(default_tokenizer, skip):
    ids = default_tokenizer.encode("Hello 🌍") + [default_tokenizer.eos_token_id] + default_tokenizer.encode(" after ✓")
    _, deltas = stream_deltas(default_tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) == default_tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_flush_emits_a_dangling_partial_character(default_tokenizer):
    ids = default_tokenizer.encode("ok 🚀")
    detok = IncrementalDetokenizer(default_tokenizer)
    emitted = "".join(detok.step([t]) for t in ids[:-1])  # the rocket's last byte is missing
    assert "\ufffd" not in emitted
    assert detok.flush() != ""  # the caller gets whatever is left at the end


# ---------------------------------------------------------------------- stop strings
def test_find_stop_string_across_the_delta_boundary():
    # "world" starts in the old text ("Hello wor") and ends in the new delta ("ld!").
    assert find_stop_string("Hello world!", 3, ["world"]) == (6, "world")
    # A stop lying entirely in old text was already checked; only new matches count.
    assert find_stop_string("world and more", 5, ["world"]) is None
    # Earliest of several stops wins.
    assert find_stop_string("abc STOP end", 8, ["end", "STOP"]) == (4, "STOP")
    assert find_stop_string("no match here", 4, ["xyz"]) is None


def test_find_stop_regex_picks_the_earliest_match():
    import re

    text = "value 42; next 7."
    assert find_stop_regex(text, [re.compile(r"\d+\."), re.compile(r"\d+;")]) == (6, 9, "42;")


def make_req(tokenizer, stream=False, **params) -> Req:
    sp = SamplingParams.from_dict({"max_new_tokens": 200, **params})
    sp.verify(tokenizer.vocab_size)
    return Req(
        "r",
        tokenizer.encode("Q:"),
        sp,
        RequestOptions(stream=stream),
        tokenizer=tokenizer,
        eos_token_ids=(tokenizer.eos_token_id,),
    )


def feed(builder: OutputBuilder, r: Req, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed generated ids one at a time the way the scheduler does → (text deltas sent, final text)."""
    deltas, final = [], None
    for t in ids:
        r.output_ids.append(t)
        builder.check_finish(r, CONTEXT_LEN)
        if r.finished:
            builder.emit_final(r)
        for o in builder.collect([] if r.finished else [r]):
            deltas.append(o.text_delta)
            if o.final_text is not None:
                final = o.final_text
        if r.finished:
            break
    return deltas, final


@pytest.mark.parametrize(
    "stop, expected",
    [
        ("is 42", "The answer "),  # spans several tokens
        ("🚀", "The answer is 42 "),  # one character made of several byte tokens
        ("42 🚀 and", "The answer is "),
        ("answ", "The "),  # ends inside the token " answer": nothing after it is kept
    ],
)
def test_stop_string_spanning_tokens_is_found_and_trimmed(default_tokenizer, stop, expected):
    text = "The answer is 42 🚀 and the rest is never reached."
    ids = default_tokenizer.encode(text)
    builder = OutputBuilder(default_tokenizer, stream_interval=1)
    r = make_req(default_tokenizer, stop=[stop, "never-there"])
    _, final = feed(builder, r, ids)
    assert r.finished_reason.to_json() == {"type": "stop", "matched": stop}
    assert final == expected
    # It stopped as soon as the stop string was complete, not later.
    assert stop in default_tokenizer.decode(r.output_ids)
    assert stop not in default_tokenizer.decode(r.output_ids[:-1])

    r2 = make_req(default_tokenizer, stop=stop, no_stop_trim=True)
    _, final = feed(builder, r2, ids)
    assert final == expected + stop


def test_streamed_deltas_never_contain_text_that_is_trimmed_later(default_tokenizer):
    text = "Count: one, two, three STOP four five"
    ids = default_tokenizer.encode(text)
    builder = OutputBuilder(default_tokenizer, stream_interval=1)
    r = make_req(default_tokenizer, stream=True, stop="STOP")
    deltas, final = feed(builder, r, ids)
    assert "".join(deltas) == final == "Count: one, two, three "
    assert len(deltas) > 3  # it really streamed


def test_stop_token_id_ends_the_request_and_its_text_is_trimmed(default_tokenizer):
    ids = default_tokenizer.encode("alpha beta gamma delta")
    stop_tok = ids[2]
    builder = OutputBuilder(default_tokenizer, stream_interval=1)
    r = make_req(default_tokenizer, stop_token_ids=[stop_tok])
    _, final = feed(builder, r, ids)
    assert r.output_ids == ids[:3]  # the stop token stays in output_ids (SGLang)
    assert r.finished_reason.to_json() == {"type": "stop", "matched": stop_tok}
    assert final == default_tokenizer.decode(ids[:2])

    r2 = make_req(default_tokenizer, stop_token_ids=[stop_tok], no_stop_trim=True)
    _, final = feed(builder, r2, ids)
    assert final == default_tokenizer.decode(ids[:3])


def test_eos_before_min_new_tokens_does_not_finish(default_tokenizer):
    eos = default_tokenizer.eos_token_id
    builder = OutputBuilder(default_tokenizer, stream_interval=1)
    r = make_req(default_tokenizer, min_new_tokens=3)
    feed(builder, r, [eos])
    assert not r.finished
    feed(builder, r, default_tokenizer.encode(" x y")[:1] + [eos])
    assert r.finished_reason.to_json() == {"type": "stop", "matched": eos}


def test_max_new_tokens_finishes_with_length(default_tokenizer):
    builder = OutputBuilder(default_tokenizer, stream_interval=1)
    r = make_req(default_tokenizer, max_new_tokens=4)
    feed(builder, r, default_tokenizer.encode("one two three four five six"))
    assert len(r.output_ids) == 4
    assert r.finished_reason.to_json() == {"type": "length", "length": 4}


# ---------------------------------------------------------------------- batched detokenization
def test_text_decoder_matches_tokenizer_decode(default_tokenizer):
    from plait.runtime.detokenizer import TextDecoder

    dec = TextDecoder(default_tokenizer)
    assert dec._rust is not None  # the fast path is really taken for this tokenizer
    seqs = [default_tokenizer.encode(t) for t in MULTIBYTE_TEXTS] + [[default_tokenizer.eos_token_id, 42], []]
    seqs += [ids[i : i + 2] for ids in seqs[:1] for i in range(len(ids))]  # windows that split characters
    for skip in (True, False):
        want = [default_tokenizer.decode(s, skip_special_tokens=skip) for s in seqs]
        assert dec.decode_many(seqs, skip) == want
        assert [dec.decode(s, skip) for s in seqs] == want


def test_step_many_equals_stepping_each_detokenizer(default_tokenizer):
    from plait.runtime.detokenizer import TextDecoder, step_many

    streams = [default_tokenizer.encode(t) for t in MULTIBYTE_TEXTS]
    eos = default_tokenizer.eos_token_id
    streams.append(default_tokenizer.encode("Hi") + [eos] + default_tokenizer.encode(" 🚀 x"))
    length = min(map(len, streams))
    dec = TextDecoder(default_tokenizer)
    # Mixed settings in one batch: a shared decoder, a raw tokenizer, both skip flags, and no tokenizer.
    make = [
        lambda: IncrementalDetokenizer(dec, True),
        lambda: IncrementalDetokenizer(default_tokenizer, False),
        lambda: IncrementalDetokenizer(dec, False),
        lambda: IncrementalDetokenizer(None),
    ]
    one = [make[i % len(make)]() for i in range(len(streams))]
    many = [make[i % len(make)]() for i in range(len(streams))]
    for pos in range(length):
        want = [d.step([s[pos]]) for d, s in zip(one, streams)]
        assert step_many(many, [s[pos] for s in streams]) == want
    for a, b in zip(one, many):
        assert (a.text, a.ids, a.prefix_offset, a.read_offset) == (b.text, b.ids, b.prefix_offset, b.read_offset)
        assert a.flush() == b.flush()
    assert any("\ufffd" in default_tokenizer.decode([t]) for s in streams for t in s[:length])


def test_check_finish_many_equals_one_request_at_a_time(default_tokenizer):
    text = "The answer is 42 🚀 and the rest is never reached."
    ids = default_tokenizer.encode(text)
    params = [
        {"stop": "is 42"},
        {"stop": "🚀", "no_stop_trim": True},
        {"stop_token_ids": [ids[3]]},
        {"stop_token_ids": [ids[3]], "no_stop_trim": True},
        {"max_new_tokens": 5},
        {"stop_regex": r"\d+ "},
        {},
    ]

    def run(batched: bool):
        builder = OutputBuilder(default_tokenizer, stream_interval=1)
        reqs = [make_req(default_tokenizer, **p) for p in params]
        for t in ids:
            live = [r for r in reqs if not r.finished]
            for r in live:
                r.output_ids.append(t)
            if batched:
                builder.check_finish_many(live, CONTEXT_LEN)
            else:
                for r in live:
                    builder.check_finish(r, CONTEXT_LEN)
        for r in reqs:
            if r.finished:
                builder.emit_final(r)
        return [(r.output_ids, r.finished_reason, r.final_text, r.detok.text) for r in reqs]

    assert run(batched=True) == run(batched=False)
    assert all(reason is not None for _, reason, _, _ in run(batched=True)[:-1])


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"stop_token_ids": "third"},
        {"stop_token_ids": "third", "no_stop_trim": True},
        {"max_new_tokens": 4},
        {"skip_special_tokens": False},
    ],
)
def test_deferred_text_decoded_by_the_receiver_equals_the_schedulers(default_tokenizer, params):
    """A request nobody reads text from until the end leaves decoding to the tokenizer manager: what
    it decodes from (output ids, DeferredText) equals the text the scheduler would have sent."""
    from plait.runtime.detokenizer import TextDecoder, decode_as_stepped

    ids = (
        default_tokenizer.encode("Café 🚀 alpha")
        + [default_tokenizer.eos_token_id]
        + default_tokenizer.encode(" beta 日本 gamma")
    )
    if params.get("stop_token_ids") == "third":
        params = {**params, "stop_token_ids": [ids[2]]}

    def final(defer: bool):
        sp = SamplingParams.from_dict({"max_new_tokens": 200, "ignore_eos": True, **params})
        r = Req("r", [1, 2], sp, tokenizer=TextDecoder(default_tokenizer), defer_text=defer)
        builder = OutputBuilder(default_tokenizer, stream_interval=1)
        for t in ids:
            r.output_ids.append(t)
            builder.check_finish(r, CONTEXT_LEN)
            if r.finished:
                break
        if not r.finished:
            r.finished_reason = FinishReason("length", length=len(r.output_ids))
        builder.emit_final(r)
        (out,) = builder.collect([])
        return r, out

    r, out = final(defer=True)
    assert r.defer_text and out.deferred_text is not None
    ref_r, ref = final(defer=False)
    assert ref.deferred_text is None and ref.final_text != ""
    text = decode_as_stepped(
        TextDecoder(default_tokenizer),
        [out.new_ids[: out.deferred_text.num_ids]],
        [out.deferred_text.skip_special_tokens],
    )[0]
    assert (out.new_ids, out.finished_reason, text) == (ref.new_ids, ref.finished_reason, ref.final_text)


def test_text_is_decoded_in_the_scheduler_when_it_is_read_early(default_tokenizer):
    from plait.runtime.detokenizer import TextDecoder

    dec = TextDecoder(default_tokenizer)
    for params, stream in (({"stop": "x"}, False), ({"stop_regex": "x+"}, False), ({}, True)):
        r = Req(
            "r", [1], SamplingParams.from_dict(params), RequestOptions(stream=stream), tokenizer=dec, defer_text=True
        )
        assert not r.defer_text and r.detok.decoder is dec


def test_decode_as_stepped_equals_stepping_one_token_at_a_time(default_tokenizer):
    import random

    from plait.runtime.detokenizer import TextDecoder, decode_as_stepped

    eos = default_tokenizer.eos_token_id
    seqs = [default_tokenizer.encode(t) for t in MULTIBYTE_TEXTS]
    seqs.append(default_tokenizer.encode("ok 🚀")[:-1])  # ends inside a character: flush emits the rest
    seqs.append([eos] + default_tokenizer.encode("👩‍👩‍👧 x") + [eos, eos])
    rng = random.Random(0)
    seqs += [[rng.randrange(0, default_tokenizer.vocab_size) for _ in range(60)] for _ in range(4)]
    seqs.append([])
    dec = TextDecoder(default_tokenizer)
    for skip in (True, False):
        want = []
        for ids in seqs:
            d = IncrementalDetokenizer(default_tokenizer, skip)
            for t in ids:
                d.step([t])
            d.flush()
            want.append(d.text)
        assert decode_as_stepped(dec, seqs, [skip] * len(seqs)) == want
        assert decode_as_stepped(default_tokenizer, seqs, [skip] * len(seqs)) == want
