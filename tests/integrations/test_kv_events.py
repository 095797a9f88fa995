"""KV events (`--kv-events-endpoint`): a subscriber that knows only vLLM's wire format (ZMQ frames, MessagePack
batches of BlockStored / BlockRemoved / AllBlocksCleared) rebuilds the server's cache from them, and what it
rebuilt is exactly the radix tree's complete blocks, through inserts, splits, evictions and flushes."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq
from helpers.fake_runner import fake_scheduler
from plait.runtime.io_struct import FlushCacheReq, TokenizedGenerateReq
from plait.runtime.kvcache.block_events import BlockEvents, block_hash
from plait.runtime.kvcache.memory_pool import TokenAllocator
from plait.runtime.kvcache.radix_cache import RadixCache
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams


class RebuiltCache:
    """What an external router keeps of one server: block hash -> (parent hash, token ids)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple] = {}
        self.next_seq = 0
        self.seen: dict[str, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply_frames(self, frames: list[bytes]) -> None:
        topic, seq, payload = frames
        assert topic == b"" and int.from_bytes(seq, "big") == self.next_seq  # no batch lost or reordered
        self.next_seq += 1
        batch = msgpack.unpackb(payload)
        assert set(batch) == {"ts", "events"} and isinstance(batch["ts"], float)
        for event in batch["events"]:
            self.apply(event)

    def apply(self, event: dict) -> None:
        kind = event["type"]
        self.seen[kind] += 1
        if kind == "AllBlocksCleared":
            self.blocks.clear()
        elif kind == "BlockRemoved":
            assert set(event) == {"type", "block_hashes", "medium"} and event["medium"] == "CPU"
            for h in event["block_hashes"]:
                del self.blocks[h]  # (a KeyError: removed what was never stored)
        else:
            assert kind == "BlockStored", kind
            b = event["block_size"]
            assert event["lora_id"] is None and event["lora_name"] is None and event["medium"] == "CPU"
            assert len(event["token_ids"]) == b * len(event["block_hashes"])
            parent = event["parent_block_hash"]
            assert parent is None or parent in self.blocks  # a block's parent is always cached before it
            for i, h in enumerate(event["block_hashes"]):
                tokens = tuple(event["token_ids"][i * b : (i + 1) * b])
                assert h == block_hash(parent, tokens)  # the chain a router recomputes from token ids
                assert h not in self.blocks
                self.blocks[h] = (parent, tokens)
                parent = h

    def prefixes(self) -> set[tuple]:
        out = set()
        for h in self.blocks:
            parts = []
            while h is not None:
                parent, tokens = self.blocks[h]  # (a KeyError: an orphan, its parent removed first)
                parts.append(tokens)
                h = parent
            out.add(tuple(t for part in reversed(parts) for t in part))
        return out


def tree_prefixes(cache: RadixCache, block_size: int) -> set[tuple]:
    """Every complete block of every cached path, as the token prefix it ends."""
    out, stack = set(), [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + child.key
            out.update(full[:end] for end in range(block_size, len(full) + 1, block_size) if end > len(path))
            stack.append((child, full))
    return out


def subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before a subscriber has joined
    return sub


def drain_frames(sub: zmq.Socket, rebuilt: RebuiltCache) -> None:
    while sub.poll(200):
        rebuilt.apply_frames(sub.recv_multipart())


@pytest.mark.parametrize("page_size,block_size", [(1, 4), (2, 4), (1, 1)])
def test_subscriber_rebuilds_the_tree_through_the_scheduler(page_size, block_size):
    rng = random.Random(page_size * 10 + block_size)
    s = fake_scheduler(
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_block_size=block_size,
        page_size=page_size,
        max_running_requests=4,
    )
    sub = subscriber(s.kv_events.endpoint)
    rebuilt = RebuiltCache()
    cache = s.kv.cache
    stems = [[rng.randrange(2, 60) for _ in range(rng.randrange(3, 30))] for _ in range(5)]
    try:
        for round_ in range(6):
            for i in range(8):  # shared stems, own tails: splits mid-edge and mid-block
                ids = rng.choice(stems)[: rng.randrange(1, 30)] + [
                    rng.randrange(2, 60) for _ in range(rng.randrange(0, 12))
                ]
                sp = SamplingParams(max_new_tokens=rng.randrange(1, 6), temperature=0, ignore_eos=True)
                s.handle_message(TokenizedGenerateReq(ids or [5], sp, RequestOptions(rid=f"r{round_}-{i}")))
            for _ in range(400):  # the pool (256 slots) is small: later rounds evict earlier prefixes
                s.step()
                s.collect_outputs()
                s.kv_events.publish()
                if s.is_idle():
                    break
            assert s.is_idle() and s.check_integrity(), s.last_integrity_error
            if round_ == 3:
                assert s.handle_message(FlushCacheReq(call_id=1)).result is True
                s.kv_events.publish()
            drain_frames(sub, rebuilt)
            want = tree_prefixes(cache, block_size)
            assert rebuilt.prefixes() == want, round_
        assert cache.hit_stats.matched_tokens > 0  # prefixes were shared
        assert min(rebuilt.seen.values()) > 0, rebuilt.seen  # blocks stored, evicted, all cleared
    finally:
        sub.close(linger=0)
        s.kv_events.close()


def test_evictions_are_reported_and_no_listener_costs_nothing():
    allocator = TokenAllocator(64, "cpu")
    events = BlockEvents(block_size=2, medium="CPU")
    cache = RadixCache(allocator, listener=events)
    rebuilt = RebuiltCache()
    for ids in ([1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]):
        kv = allocator.alloc(len(ids))
        cache.cache_finished_req(ids, kv, None)
    for event in events.take():
        rebuilt.apply(event)
    # [1,2,3] is one edge now, [4,5] and [9] below it: the second block of each path starts in the shared
    # edge and ends in its own; [5] ends no block.
    assert rebuilt.prefixes() == tree_prefixes(cache, 2) == {(1, 2), (1, 2, 3, 4), (1, 2, 3, 9), (7, 8)}
    cache.evict(64)
    for event in events.take():
        rebuilt.apply(event)
    assert rebuilt.prefixes() == set() and cache.total_size() == 0
    assert RadixCache(TokenAllocator(8, "cpu")).listener is None


def test_settings_refuse_what_cannot_publish():
    from plait.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="multiple of page_size 4"):
        ServerArgs(page_size=4, kv_events_block_size=6)
    with pytest.raises(ValueError, match="ZMQ address"):
        ServerArgs(kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="radix cache"):
        ServerArgs(kv_events_endpoint="tcp://*:5557", disable_radix_cache=True)


def test_an_engine_publishes_from_its_scheduler_process(default_tokenizer):
    from conftest import free_port
    from plait.runtime import Engine

    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    rebuilt = RebuiltCache()
    prompt = "The bakery opens at seven and closes at six; it bakes sourdough daily and croissants on weekends."
    ids = default_tokenizer.encode(prompt)
    with Engine(
        kv_events_endpoint=f"tcp://*:{port}", kv_events_block_size=8, num_threads=1, max_total_tokens=2048
    ) as eng:
        time.sleep(0.3)  # the subscriber joins before anything is published
        eng.generate(input_ids=[ids, ids + [13]], sampling_params={"max_new_tokens": 3, "temperature": 0})
        drain_frames(sub, rebuilt)
        assert rebuilt.seen["BlockStored"] > 0
        assert tuple(ids[: 8 * (len(ids) // 8)]) in rebuilt.prefixes()  # the prompt's complete blocks
        assert eng.flush_cache()
        drain_frames(sub, rebuilt)
    sub.close(linger=0)
    assert rebuilt.seen["AllBlocksCleared"] == 1 and rebuilt.blocks == {}
