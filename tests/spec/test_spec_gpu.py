"""Speculative decoding on a GPU: verify steps through their CUDA graphs (executor/verify_graphs.py) and the
triton tree kernel at real sizes, against eager verify steps and plain decoding. Marked gpu: skipped
where no CUDA device exists (this repository's CPU suite)."""

from __future__ import annotations

import pytest
import torch
from helpers.scheduler_loop import run_until_idle
from plait.runtime.io_struct import TokenizedGenerateReq
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import create_scheduler
from plait.runtime.server_args import ServerArgs

pytestmark = pytest.mark.gpu


def _run(s, prompts, n_new=32) -> dict:
    for i, p in enumerate(prompts):
        s.handle_message(
            TokenizedGenerateReq(
                p,
                SamplingParams(max_new_tokens=n_new, temperature=0, ignore_eos=True),
                RequestOptions(rid=f"r{i}"),
            )
        )
    return run_until_idle(s)


def _prompts(n: int, repeat: bool) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        p = torch.randint(100, 20000, (48,), generator=g).tolist()
        out.append(p + p[:24] if repeat else p)  # a repeated span gives prompt lookup something to find
    return out


def _scheduler(**kw):
    sa = ServerArgs(
        model_path="smollm2-135m",
        load_format="dummy",
        device="cuda",
        dtype="float32",
        max_total_tokens=32768,
        max_running_requests=32,
        **kw,
    )
    return create_scheduler(sa, "smollm2-135m")


def test_ngram_with_verify_graphs_matches_plain_decoding_on_the_gpu():
    prompts = _prompts(12, repeat=True)
    plain = _run(_scheduler(), prompts)
    spec = _scheduler(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    assert spec.runner.verify.graphs is not None
    assert _run(spec, prompts) == plain
    assert _run(spec, prompts[:1]) == {"r0": plain["r0"]}
    assert spec.get_stats()["spec_verify_steps"] > 0


def test_a_verify_graph_replay_equals_the_eager_verify_step():
    import numpy as np
    from plait.runtime.speculative.tree import DraftTree
    from plait.runtime.speculative.verify_step import build_verify_step

    s = _scheduler(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    mr = s.runner
    prompts = _prompts(3, repeat=False)
    _run(s, prompts, n_new=1)  # prefills fill the cache; their slots stay in the tree
    rows, kv_lens, trees = [], [], []
    for i, p in enumerate(prompts):
        rows.append(mr.req_to_token_pool.alloc())
        kv = s.kv.cache.match_prefix(p).kv_indices
        mr.req_to_token_pool.write(rows[-1], 0, kv)
        kv_lens.append(len(kv))
        trees.append(DraftTree([p[-1], 5, 6, 7, 8], [-1, 0, 1, 0, 3]) if i % 2 else DraftTree.chain(p[-1], [9, 10]))
    n = sum(t.size for t in trees)
    slots = mr.allocator.alloc(n)
    step = build_verify_step(rows, kv_lens, trees, slots.numpy())
    step.sampling = [None] * 3
    logits_graph, hidden_graph, _ = mr.verify.graphs.replay(step)
    # NOTE: the runner's staging buffers are inference tensors (made inside its inference_mode steps): the
    # eager reference step runs in inference mode too, as the runner's own steps do.
    with torch.inference_mode():
        fb = mr.forward.batch(step)
        mr.memory.attn_backend.init_forward_metadata(fb)
        hidden = mr.model(fb.input_ids, fb.positions, fb)
    torch.testing.assert_close(hidden_graph, hidden, atol=2e-4, rtol=2e-4)
    with torch.inference_mode():
        logits = mr.model.compute_logits(hidden)
    torch.testing.assert_close(logits_graph, logits, atol=2e-3, rtol=2e-3)
    mr.allocator.free(slots)
    for r in rows:
        mr.req_to_token_pool.free(r)
    assert np.isfinite(logits_graph.cpu().numpy()).all()
