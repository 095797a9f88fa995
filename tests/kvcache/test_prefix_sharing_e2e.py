"""End to end on the real default model: RadixAttention prefix reuse must never change greedy outputs.

Two engines run side by side: the radix cache on and off (`disable_radix_cache=True`). Prompts are
built as token ids so the expected cache hit is exact: a request reuses every token its prompt shares
with what earlier requests computed (their prompt plus all but the last generated token), except the
last prompt token, which is always recomputed for its logits.
"""

import asyncio
import random

import pytest
from plait.runtime import Engine

POOL = 1024  # KV slots per engine: small, so the eviction test overflows it quickly
ENGINE_ARGS = dict(num_threads=1, max_total_tokens=POOL, chunked_prefill_size=128)
GREEDY = {"max_new_tokens": 10, "temperature": 0}

FEW_SHOT = (
    "Answer each question with a single word.\n"
    "Q: What is the opposite of hot?\nA: cold\n"
    "Q: What color is grass?\nA: green\n"
    "Q: How many legs does a spider have?\nA: eight\n"
    "Q: What do bees make?\nA: honey\n"
    "Q: What is the largest planet?\nA: Jupiter\n"
)
QUESTIONS = [
    "What color is the sky?",
    "What is frozen water called?",
    "What animal says moo?",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def engine_on():
    with Engine(**ENGINE_ARGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine_off():
    with Engine(disable_radix_cache=True, **ENGINE_ARGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def few_shot_prompts(engine_on):
    encode = engine_on.tokenizer.encode
    prefix = encode(FEW_SHOT)
    return prefix, [prefix + encode(f"Q: {q}\nA:") for q in QUESTIONS]


@pytest.fixture(scope="module")
def few_shot_reference(engine_off, few_shot_prompts):
    _, prompts = few_shot_prompts
    return [engine_off.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]


def common_len(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_hit(computed, prompt):
    """Longest prefix of `prompt[:-1]` among token sequences whose KV was computed (and kept)."""
    return max((common_len(seq, prompt[:-1]) for seq in computed), default=0)


def assert_all_slots_returned(engine):
    assert engine.check_integrity()
    stats = engine.get_stats()
    assert stats["protected_tokens"] == 0 and stats["integrity_errors"] == 0
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["max_total_tokens"] == POOL


def test_few_shot_outputs_identical_and_prefix_reused(engine_on, few_shot_prompts, few_shot_reference):
    prefix, prompts = few_shot_prompts
    assert engine_on.flush_cache()
    computed = []
    for prompt, want in zip(prompts, few_shot_reference):
        out = engine_on.generate(input_ids=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens"] == expected_hit(computed, prompt)
        computed.append(prompt + out["output_ids"][:-1])
    # Every request after the first skipped at least the whole few-shot prefix.
    hits = [expected_hit(computed[:i], p) for i, p in enumerate(prompts)]
    assert hits[0] == 0 and min(hits[1:]) >= len(prefix)
    assert_all_slots_returned(engine_on)


def test_multi_turn_chat_reuses_history(engine_on, engine_off):
    encode = engine_on.tokenizer.encode
    turns = ["Hi! Name a fruit.", "Why do you like it?", "Name another one."]
    assert engine_on.flush_cache()
    history = {"on": [], "off": []}
    computed = []
    for i, text in enumerate(turns):
        user = encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
        outs = {}
        for name, eng in (("on", engine_on), ("off", engine_off)):
            history[name] += user
            outs[name] = eng.generate(input_ids=history[name], sampling_params=GREEDY)
            history[name] += outs[name]["output_ids"]
        assert outs["on"]["output_ids"] == outs["off"]["output_ids"], f"turn {i} differs"
        prompt = history["on"][: len(history["on"]) - len(outs["on"]["output_ids"])]
        assert outs["on"]["meta_info"]["cached_tokens"] == expected_hit(computed, prompt)
        if i:  # the whole previous exchange was served from the cache
            assert outs["on"]["meta_info"]["cached_tokens"] >= len(computed[-1])
        computed.append(prompt + outs["on"]["output_ids"][:-1])
        assert outs["off"]["meta_info"]["cached_tokens"] == 0
    assert_all_slots_returned(engine_on)


def test_concurrent_requests_with_shared_prefix(engine_on, few_shot_prompts, few_shot_reference):
    _, prompts = few_shot_prompts
    assert engine_on.flush_cache()
    # One batch call, then the same prompts again as concurrent async calls (cache warm this time).
    batch = engine_on.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == few_shot_reference

    async def concurrent():
        return await asyncio.gather(*[engine_on.async_generate(input_ids=p, sampling_params=GREEDY) for p in prompts])

    outs = asyncio.run(concurrent())
    assert [o["output_ids"] for o in outs] == few_shot_reference
    assert all(o["meta_info"]["cached_tokens"] >= len(few_shot_prompts[0]) for o in outs)
    assert_all_slots_returned(engine_on)


def test_workload_larger_than_pool_evicts_and_returns_every_slot(engine_on, engine_off):
    rng = random.Random(0)
    words = "river stone cloud lantern orchard violin harbor meadow copper whisper candle".split()
    docs = [f"Document {i}: " + " ".join(rng.choice(words) for _ in range(250)) + "\nSummary:" for i in range(6)]
    prompts = [engine_on.tokenizer.encode(d) for d in docs]
    short = {"max_new_tokens": 4, "temperature": 0}
    assert sum(map(len, prompts)) > POOL + 200  # the cache cannot hold them all
    want = [engine_off.generate(input_ids=p, sampling_params=short)["output_ids"] for p in prompts]

    assert engine_on.flush_cache()
    for p, w in zip(prompts, want):
        assert engine_on.generate(input_ids=p, sampling_params=short)["output_ids"] == w
    assert_all_slots_returned(engine_on)
    # LRU: the first document was evicted to make room for the later ones, and recomputing it
    # after eviction still gives the same answer.
    again = engine_on.generate(input_ids=prompts[0], sampling_params=short)
    assert again["meta_info"]["cached_tokens"] < len(prompts[0]) // 2
    assert again["output_ids"] == want[0]
    # All at once: admission has to evict while other requests hold locked prefixes.
    outs = engine_on.generate(input_ids=prompts, sampling_params=[short] * len(prompts))
    assert [o["output_ids"] for o in outs] == want
    assert_all_slots_returned(engine_on)


def test_flush_cache_empties_the_tree(engine_on, few_shot_prompts):
    _, prompts = few_shot_prompts
    engine_on.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert engine_on.get_stats()["evictable_tokens"] > 0
    assert engine_on.flush_cache()
    stats = engine_on.get_stats()
    assert stats["evictable_tokens"] == 0 and stats["free_tokens"] == POOL
    assert engine_on.generate(input_ids=prompts[0], sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0


def test_retraction_while_shared_prefix_is_locked(engine_off, few_shot_prompts):
    # 160 KV slots cannot hold four 46-token prompts decoding 30 tokens each, even sharing their
    # 35-token prefix: decode runs short and retracts a request whose prefix path is locked by the
    # others; it resumes later from the cache. Small prefill budgets admit the first request alone.
    small = dict(num_threads=1, max_total_tokens=160, chunked_prefill_size=32, max_prefill_tokens=32)
    encode = engine_off.tokenizer.encode
    prefix = encode(FEW_SHOT.split("Q: How many")[0])
    prompts = [prefix + encode(f"Q: {q}\nA:") for q in QUESTIONS]
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    want = [engine_off.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    with Engine(**small) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
        stats = eng.get_stats()
        assert eng.check_integrity()
    assert [o["output_ids"] for o in outs] == want
    assert stats["num_retractions"] > 0
    assert stats["cached_tokens"] >= len(prefix)
    assert stats["protected_tokens"] == 0 and stats["free_tokens"] + stats["evictable_tokens"] == 160
