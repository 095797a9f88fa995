"""The hierarchical cache on a model split over ranks (issue 33), on the CPU: each rank its own process (gloo
over loopback) and its own host shard; rank 0's scheduler decides every copy, and the other ranks replay them
on their own KV pools and shards before the next step (kvcache/host_copies.py).

A multi-turn workload whose working set is several times a tiny device pool, so the earlier turns' prefixes
are demoted to the host tier between a conversation's turns and loaded back: with tp_size 2 (and pp_size 2)
the greedy outputs are the one-device engine's with the tier on and the same split with the tier off, host
hits are served, and both tiers pass the integrity check after every turn. A rank that missed a load-back
would attend over stale K/V in the slots and change the outputs.
"""

from __future__ import annotations

import random

import pytest
from helpers.model_folders import build_tokenizer, make_folder
from plait.runtime import Engine

pytestmark = pytest.mark.timeout(900)

POOL = 160
ENGINE_ARGS = dict(num_threads=1, max_total_tokens=POOL, chunked_prefill_size=64, max_running_requests=2)
TIER = dict(enable_hierarchical_cache=True, hicache_ratio=6.0)
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
CONVERSATIONS, TURNS = 6, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # 4 query heads, 2 KV heads: at TP = 2 each rank 2 + 1, and a host shard of its one KV head.
    root = tmp_path_factory.mktemp("hicache_parallel")
    return make_folder(root / "llama", "llama", tokenizer=build_tokenizer(), max_position_embeddings=512)


def conversation_turns(engine: Engine, metas: list) -> list[list[int]]:
    """Conversations whose histories grow each turn (the last answer and a new user message)."""
    rng = random.Random(0)
    histories = [[rng.randrange(3, 300) for _ in range(24)] for _ in range(CONVERSATIONS)]
    outputs = []
    for _ in range(TURNS):
        for i, r in enumerate(engine.generate(input_ids=histories, sampling_params=GREEDY)):
            outputs.append(r["output_ids"])
            metas.append(r["meta_info"])
            histories[i] = histories[i] + r["output_ids"] + [rng.randrange(3, 300) for _ in range(10)]
        assert engine.check_integrity()
    assert sum(map(len, histories)) > 3 * POOL
    return outputs


def run(folder: str, **args) -> tuple[list, list, dict]:
    with Engine(folder, **ENGINE_ARGS, **args) as engine:
        metas: list = []
        outputs = conversation_turns(engine, metas)
        stats = engine.get_stats()
        if args.get("enable_hierarchical_cache"):
            assert engine.flush_cache()
            assert engine.get_stats()["hicache_host_used_tokens"] == 0
            assert engine.check_integrity()
    return outputs, metas, stats


@pytest.fixture(scope="module")
def one_device_tiered(folder):
    return run(folder, **TIER)


def assert_host_hits(metas: list, stats: dict) -> None:
    details = [m["cached_tokens_details"] for m in metas]
    assert all(d["device"] + d["host"] == m["cached_tokens"] for d, m in zip(details, metas))
    assert sum(d["host"] for d in details) > 0
    assert stats["hicache_num_loads"] > 0 and stats["hicache_loaded_tokens"] > 0


def test_tp2_with_the_tier_gives_one_device_and_the_tier_off(folder, one_device_tiered):
    want, one_metas, one_stats = one_device_tiered
    assert_host_hits(one_metas, one_stats)
    off, _, off_stats = run(folder, tp_size=2)
    on, metas, stats = run(folder, tp_size=2, **TIER)
    assert on == off
    assert on == want
    assert_host_hits(metas, stats)
    assert stats["cached_tokens"] > off_stats["cached_tokens"]
    # Rank 0 decides alone: the same copies as on one device.
    assert stats["hicache_loaded_tokens"] == one_stats["hicache_loaded_tokens"]


def test_pp2_with_the_tier_gives_one_device(folder, one_device_tiered):
    want, _, one_stats = one_device_tiered
    on, metas, stats = run(folder, pp_size=2, **TIER)
    assert on == want
    assert_host_hits(metas, stats)
    assert stats["hicache_loaded_tokens"] == one_stats["hicache_loaded_tokens"]
