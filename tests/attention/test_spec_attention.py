"""Draft-tree attention (ForwardMode.VERIFY) in the torch_native and triton backends against a float64
reference over a real paged pool: whole trees (a target's verify step), trees grown by one level (a
draft model's tree step: new tokens are the last columns of the tree), and chains (no mask).

On a machine without CUDA the triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py) at tiny shapes with tiny tiles, so the prefix and tree phases each walk several tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plait.runtime.attention import AttentionContext
from plait.runtime.attention.base import AttentionLayerSpec
from plait.runtime.attention.torch_native import TorchNativeAttnBackend
from plait.runtime.forward_batch import ForwardBatch, ForwardMode
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool
from plait.runtime.speculative.tree import DraftTree

TINY = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


def random_tree(n: int, g: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree(list(range(n)), parents)


class _Case:
    """Requests with a prefix of `prefix_lens[b]` keys and a tree of `trees[b]` (its last `new_lens[b]`
    nodes are this step's queries), their K/V at scattered slots of a real pool."""

    def __init__(self, prefix_lens, trees, new_lens, heads=4, kv_heads=2, head_dim=16, seed=0, chain=False):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5)
        self.prefix_lens, self.trees, self.new_lens, self.chain = prefix_lens, trees, new_lens, chain
        lens = [p + t.size for p, t in zip(prefix_lens, trees)]
        self.num_slots = sum(lens) + 5
        self.kv_pool = KVPool(self.num_slots, 1, kv_heads, head_dim, torch.float32, "cpu")
        for buf in self.kv_pool.k_buffer + self.kv_pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g))
        self.r2t = ReqToTokenPool(len(lens) + 2, max(lens) + 4, "cpu")
        slots = torch.randperm(self.num_slots, generator=g)[: sum(lens)] + 1
        self.rows = torch.randperm(self.r2t.size, generator=g)[: len(lens)].tolist()
        self.slots, at = [], 0
        for row, n in zip(self.rows, lens):
            self.r2t.write(row, 0, slots[at : at + n])
            self.slots.append(slots[at : at + n])
            at += n
        total_new = sum(new_lens)
        self.q = torch.randn(total_new, heads, head_dim, generator=g)

    def forward_batch(self, backend) -> ForwardBatch:
        B = len(self.trees)
        ext = torch.tensor(self.new_lens)
        tree_lens = torch.tensor([t.size for t in self.trees])
        fb = ForwardBatch(
            forward_mode=ForwardMode.VERIFY,
            batch_size=B,
            input_ids=torch.zeros(sum(self.new_lens), dtype=torch.long),
            positions=torch.zeros(sum(self.new_lens), dtype=torch.long),
            req_pool_indices=torch.tensor(self.rows),
            seq_lens=torch.tensor(self.prefix_lens) + tree_lens,
            out_cache_loc=torch.zeros(sum(self.new_lens), dtype=torch.long),
            seq_lens_cpu=[p + t.size for p, t in zip(self.prefix_lens, self.trees)],
            req_to_token_pool=self.r2t,
            kv_pool=self.kv_pool,
            attn_backend=backend,
        )
        fb.extend_prefix_lens, fb.extend_seq_lens = torch.tensor(self.prefix_lens), ext
        fb.extend_start_loc = torch.cumsum(ext, 0) - ext
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(self.prefix_lens), list(self.new_lens)
        fb.tree_lens, fb.tree_lens_cpu = tree_lens, [t.size for t in self.trees]
        if not self.chain:
            blocks = [t.ancestor_mask()[t.size - e :] for t, e in zip(self.trees, self.new_lens)]  # (E, N) each
            sizes = np.array([b.size for b in blocks])
            fb.tree_mask = torch.from_numpy(np.concatenate([b.reshape(-1) for b in blocks]))
            fb.tree_mask_offsets = torch.from_numpy(np.cumsum(sizes) - sizes)
        backend.init_forward_metadata(fb)
        return fb

    def reference(self) -> torch.Tensor:
        lay = self.layer
        group = lay.num_heads // lay.num_kv_heads
        k_buf, v_buf = self.kv_pool.k_buffer[0].double(), self.kv_pool.v_buffer[0].double()
        out, at = [], 0
        for b, (pre, tree, e) in enumerate(zip(self.prefix_lens, self.trees, self.new_lens)):
            mask = tree.ancestor_mask()
            for j in range(e):
                node = tree.size - e + j
                seen = list(range(pre)) + [pre + c for c in range(tree.size) if mask[node, c]]
                idx = self.slots[b][seen]
                q = self.q[at].double()  # (H, D)
                k = k_buf[idx].repeat_interleave(group, dim=1)  # (S, H, D)
                v = v_buf[idx].repeat_interleave(group, dim=1)
                w = torch.softmax(torch.einsum("hd,shd->hs", q, k) * lay.scaling, dim=-1)
                out.append(torch.einsum("hs,shd->hd", w, v).reshape(-1))
                at += 1
        return torch.stack(out)


def _cases():
    g = torch.Generator().manual_seed(7)
    trees = [random_tree(n, g) for n in (6, 1, 9, 4)]
    chains = [DraftTree.chain(0, list(range(1, n))) for n in (5, 1, 8, 3)]
    return {
        "verify trees": _Case([37, 3, 20, 1], trees, [t.size for t in trees]),
        "tree grown by a level": _Case([37, 3, 20, 1], trees, [3, 1, 4, 2], seed=1),
        "chains": _Case([37, 3, 20, 1], chains, [c.size for c in chains], seed=2, chain=True),
        "chain drafting step": _Case([37, 3, 20, 1], chains, [1, 1, 1, 1], seed=3, chain=True),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_torch_native_verify_attends_to_the_prefix_and_tree_ancestors(name):
    case = CASES[name]
    backend = TorchNativeAttnBackend(AttentionContext("cpu"))
    fb = case.forward_batch(backend)
    out = backend.forward_verify(case.q.clone(), case.layer, fb)
    torch.testing.assert_close(out.double(), case.reference(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_verify_matches_the_reference(name):
    from plait.runtime.attention.triton_backend import TritonAttnBackend
    from plait.runtime.attention.triton_ops import ExtendConfig

    case = CASES[name]
    backend = TritonAttnBackend(AttentionContext("cpu"), extend_config=ExtendConfig(**TINY))
    fb = case.forward_batch(backend)
    out = backend.forward_verify(case.q.clone(), case.layer, fb)
    torch.testing.assert_close(out.double(), case.reference(), atol=1e-4, rtol=1e-4)


def test_triton_tree_kernel_over_a_verify_graphs_padded_layout():
    """What a verify CUDA graph of more tokens than the step's runs (executor/verify_graphs.py): the step's
    rows first, then dead rows as one more request (prefix 0, each sees its first node and itself, over
    table columns of the first request's row), then a request slot with no tokens, the grid sized for the
    whole graph. More dead rows than a key tile: a row that sees no key of a tile must stay finite."""
    from plait.runtime.attention.triton_ops import ExtendConfig, tree_attention

    case = CASES["verify trees"]
    sizes = [t.size for t in case.trees]
    T, dead = sum(sizes), 2 * TINY["block_n"] + 3
    t_cap = T + dead
    lay = case.layer
    q = torch.cat([case.q, torch.randn(dead, lay.num_heads, lay.head_dim, generator=case.g)])
    dead_mask = np.eye(dead, dtype=bool)
    dead_mask[:, 0] = True
    masks = [t.ancestor_mask().reshape(-1) for t in case.trees] + [dead_mask.reshape(-1)]
    squares = np.array([m.size for m in masks] + [0])
    lens = torch.tensor(sizes + [dead, 0])
    out = torch.full((t_cap, lay.num_heads, lay.head_dim), float("nan"))
    tree_attention(
        q,
        case.kv_pool.k_buffer[0],
        case.kv_pool.v_buffer[0],
        out,
        case.r2t.req_to_token,
        torch.tensor(case.rows + [case.rows[0], 0]),
        torch.tensor(case.prefix_lens + [0, 0]),
        lens,
        torch.tensor(np.cumsum([0] + sizes + [dead])[:-1].tolist()),
        lens,
        torch.from_numpy(np.concatenate(masks).astype(np.uint8)),
        torch.from_numpy(np.cumsum(squares) - squares),
        t_cap,
        lay.scaling,
        ExtendConfig(**TINY),
    )
    torch.testing.assert_close(out[:T].reshape(T, -1).double(), case.reference(), atol=1e-4, rtol=1e-4)
    assert torch.isfinite(out[T:]).all()
