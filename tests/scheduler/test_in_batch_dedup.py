"""In-batch prefix dedup (scheduler/admission.py): a waiting request that shares a long enough uncached prefix
with one being prefilled in this step waits a step and then hits the cache, in-process on a tiny random
model with exact-state assertions."""

from __future__ import annotations

from test_scheduler_state import make_scheduler, run_until_idle, submit


def test_in_batch_prefix_dedup_prefills_a_shared_prefix_once(random_models):
    s = make_scheduler(random_models["llama"], max_total_tokens=1024)
    shared = list(range(2, 66))  # 64 tokens, longer than the dedup threshold
    for i in range(4):
        submit(s, f"q{i}", shared + [100 + i, 120 + i], max_new_tokens=2, temperature=0, ignore_eos=True)
    first = s.step()
    assert [r.rid for r in first.reqs] == ["q0"] and first.extend_lens == [66]
    second = s.step()
    # The other three now hit the 64 cached tokens (66-token prompts: 65 matchable, 64 shared); q0
    # decodes its second token in the same step.
    assert second.mode.is_extend() and [r.rid for r in second.decode_reqs] == ["q0"]
    assert sorted(r.rid for r in second.prefill_part()[0]) == ["q1", "q2", "q3"]
    assert second.prefix_lens[1:] == [64, 64, 64] and second.extend_lens[1:] == [2, 2, 2]
    run_until_idle(s)
    assert s.stats["cached_tokens"] == 3 * 64


def test_a_chat_templates_system_prompt_is_prefilled_once(random_models):
    # SmolLM2's template puts ~20 tokens of system prompt before every user turn: requests batched together
    # share that much and wait a step for it (a CPU prefill of 16 such prompts: 926 tokens, 420 of them shared).
    s = make_scheduler(random_models["llama"], max_total_tokens=1024)
    system = list(range(2, 22))  # 20 tokens
    for i in range(3):
        submit(s, f"q{i}", system + [100 + i] * 8, max_new_tokens=1, temperature=0)
    assert [r.rid for r in s.step().reqs] == ["q0"]
    second = s.step()
    assert sorted(r.rid for r in second.reqs) == ["q1", "q2"] and second.prefix_lens == [20, 20]


def test_short_shared_prefix_is_not_held_back(random_models):
    s = make_scheduler(random_models["llama"], max_total_tokens=1024)
    for i in range(3):
        submit(s, f"q{i}", [5, 6, 7, 8] + [100 + i], max_new_tokens=1, temperature=0)
    assert len(s.step().reqs) == 3  # a 4-token overlap is cheaper to recompute than to wait for
