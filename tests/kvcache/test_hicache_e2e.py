"""End to end on the real default model: the hierarchical cache (a host tier under the radix cache) must not
change greedy outputs, and a multi-turn workload larger than the device pool must hit in the host tier.

Two engines with the same small device pool: the radix cache alone, and with the host tier. Conversations
grow each turn (the last answer and a new question), so the earlier turns' prefixes are evicted from the
device pool between a conversation's turns; with the tier they come back from host memory.
"""

import pytest
from plait.runtime import Engine

POOL = 192
ENGINE_ARGS = dict(num_threads=1, max_total_tokens=POOL, chunked_prefill_size=128, max_running_requests=2)
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
TOPICS = ["rivers", "volcanoes", "the moon", "bread", "owls", "glass"]


def conversation_turns(engine, turns=4, metas=None) -> list[list[int]]:
    encode = engine.tokenizer.encode
    histories = [encode(f"You are a terse assistant. Tell me one fact about {t}.\n") for t in TOPICS]
    outputs = []
    for turn in range(turns):
        results = engine.generate(input_ids=histories, sampling_params=GREEDY)
        for i, r in enumerate(results):
            outputs.append(r["output_ids"])
            if metas is not None:
                metas.append(r["meta_info"])
            histories[i] = histories[i] + r["output_ids"] + encode(f"\nAnother one, number {turn + 2}?\n")
        assert engine.check_integrity()
    assert sum(map(len, histories)) > 3 * POOL
    return outputs


@pytest.mark.timeout(900)
def test_host_tier_keeps_greedy_outputs_and_serves_hits():
    with Engine(**ENGINE_ARGS) as plain:
        plain_metas: list = []
        want = conversation_turns(plain, metas=plain_metas)
        assert all("cached_tokens_details" not in m for m in plain_metas)
        plain_cached = plain.get_stats()["cached_tokens"]
    with Engine(enable_hierarchical_cache=True, hicache_ratio=4.0, **ENGINE_ARGS) as tiered:
        metas: list = []
        assert conversation_turns(tiered, metas=metas) == want
        details = [m["cached_tokens_details"] for m in metas]
        assert all(d["device"] + d["host"] == m["cached_tokens"] for d, m in zip(details, metas))
        assert sum(d["host"] for d in details) > 0
        stats = tiered.get_stats()
        assert stats["hicache_num_loads"] > 0 and stats["hicache_loaded_tokens"] > 0
        assert stats["cached_tokens"] > plain_cached
        assert tiered.flush_cache()
        assert tiered.get_stats()["hicache_host_used_tokens"] == 0
        assert tiered.check_integrity()
