"""The host tier on a GPU: pinned host memory, copies on a copy stream of their own, ordered against the
compute stream without the host waiting (host_tier.py's note), and the scheduler with it on a random model
(overlap scheduling and decode graphs on; float32, so that batches shaped differently by the cache hits do
not flip near-ties): the same greedy tokens as without it."""

from __future__ import annotations

import random

import pytest
import torch


def random_pool_and_tier(n: int):
    """A bf16 GPU pool of random K/V with a host tier under it, `n` random slots and their K/V per layer."""
    from plait.runtime.kvcache.host_tier import HostTier
    from plait.runtime.kvcache.memory_pool import KVPool

    pool = KVPool(4096, 4, 2, 64, torch.bfloat16, "cuda")
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        k.copy_(torch.randn_like(k, dtype=torch.float32))
        v.copy_(torch.randn_like(v, dtype=torch.float32))
    src = torch.randperm(4096)[:n] + 1
    want = [(k[src.cuda()].clone(), v[src.cuda()].clone()) for k, v in zip(pool.k_buffer, pool.v_buffer)]
    return pool, HostTier(pool, 8192), src, want


@pytest.mark.gpu
def test_gpu_copies_are_ordered_against_the_compute_stream():
    pool, host, src, want = random_pool_and_tier(1000)
    assert host.buffer.is_pinned() and host.copy_stream is not None
    slots = host.alloc(1000)
    host.save(src, slots)
    for k, v in zip(pool.k_buffer, pool.v_buffer):  # a later step reuses the slots at once
        k[src.cuda()] = 0
        v[src.cuda()] = 0
    dst = torch.randperm(4096)[:1000] + 1
    host.load(slots, dst)
    for (k_want, v_want), k, v in zip(want, pool.k_buffer, pool.v_buffer):  # read on the compute stream
        assert torch.equal(k[dst.cuda()], k_want) and torch.equal(v[dst.cuda()], v_want)


@pytest.mark.gpu
def test_gpu_scheduler_with_a_host_tier_gives_the_same_tokens(random_models):
    from plait.runtime.io_struct import TokenizedGenerateReq
    from plait.runtime.request_options import RequestOptions
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.scheduler import create_scheduler
    from plait.runtime.server_args import ServerArgs

    def run(**tier) -> dict:
        path = random_models["llama"]
        s = create_scheduler(
            ServerArgs(model_path=path, device="cuda", dtype="float32", max_total_tokens=1024, **tier), path
        )
        rng = random.Random(0)
        history = {c: [rng.randrange(3, 200) for _ in range(120)] for c in range(12)}
        outputs = {}
        for turn in range(3):
            for c, ids in history.items():
                params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
                s.handle_message(TokenizedGenerateReq(list(ids), params, RequestOptions(rid=f"{c}-{turn}")))
            finals: dict = {}
            while len(finals) < len(history):
                s.step()
                for o in s.collect_outputs():
                    if o.finished_reason is not None:
                        finals[o.rid] = o
            assert s.check_integrity(), s.last_integrity_error
            for c in history:
                outputs[(c, turn)] = finals[f"{c}-{turn}"].new_ids
                history[c] = history[c] + finals[f"{c}-{turn}"].new_ids + [rng.randrange(3, 200) for _ in range(40)]
        return {"outputs": outputs, "stats": s.get_stats()}

    off = run()
    on = run(enable_hierarchical_cache=True, hicache_ratio=4.0)
    assert on["outputs"] == off["outputs"]
    assert on["stats"]["hicache_num_loads"] > 0
    held = run(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_load_policy="hold")
    assert held["outputs"] == off["outputs"]  # copies and scatters on the copy stream, requests held till they land
    assert held["stats"]["hicache_num_loads"] > 0 and held["stats"]["protected_tokens"] == 0


@pytest.mark.gpu
def test_gpu_a_held_load_lands_on_the_copy_stream_and_its_event_says_when():
    pool, host, src, want = random_pool_and_tier(2000)
    slots = host.alloc(2000)
    host.save(src, slots)
    dst = torch.randperm(4096)[:2000] + 1
    done = host.load(slots, dst, hold=True)
    assert done is not None
    done.synchronize()
    for (k_want, v_want), k, v in zip(want, pool.k_buffer, pool.v_buffer):
        assert torch.equal(k[dst.cuda()], k_want) and torch.equal(v[dst.cuda()], v_want)
    assert host.load(slots, dst) is None  # without hold: the compute stream waits, nothing to poll
