"""Decode CUDA graphs: the shared logits buffer (compute_logits / forward_logits / skinny_linear / gemv
writing into `out`) and the plain + cascade graph variants.

The `out` plumbing runs on the CPU (gemv in Triton's interpreter); the graph runner needs a GPU
(`pytest -m gpu`): it captures graphs for many batch sizes at a 128k vocabulary and checks that they
keep one logits buffer between them, and that a replay picks the cascade graph only for a batch that
shares a prefix.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers.model_step import tiny_llama
from plait.runtime.attention import AttentionContext
from plait.runtime.attention.torch_native import TorchNativeAttnBackend
from plait.runtime.executor.cuda_graphs import GraphKey
from plait.runtime.forward_batch import ForwardBatch, ForwardMode
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool
from plait.runtime.models.layers import skinny_linear

torch.set_num_threads(1)


def _decode_batch(model, seq_lens: list[int], seed: int = 0) -> ForwardBatch:
    """A decode step of len(seq_lens) requests over random K/V (torch_native attention, CPU)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    kv = KVPool(total, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.norm.weight.dtype, "cpu")
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    r2t = ReqToTokenPool(len(seq_lens) + 1, max(seq_lens) + 8, "cpu")
    slots = torch.randperm(total, generator=g) + 1
    at, rows = 0, []
    for i, s in enumerate(seq_lens):
        r2t.write(i + 1, 0, slots[at : at + s])
        rows.append(i + 1)
        at += s
    backend = TorchNativeAttnBackend(AttentionContext("cpu"))
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(seq_lens),
        input_ids=torch.randint(0, cfg.vocab_size, (len(seq_lens),), generator=g),
        positions=torch.tensor(seq_lens) - 1,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.stack([r2t.req_to_token[r, s - 1].long() for r, s in zip(rows, seq_lens)]),
        seq_lens_cpu=list(seq_lens),
        req_to_token_pool=r2t,
        kv_pool=kv,
        attn_backend=backend,
        req_pool_indices_cpu=np.asarray(rows, dtype=np.int64),
    )
    backend.init_forward_metadata(fb)
    return fb


# ---------------------------------------------------------------- `out` plumbing (CPU)


@pytest.mark.parametrize("dtype,tie", [(torch.float32, False), (torch.bfloat16, True)])
def test_compute_and_forward_logits_into_out_equal_the_fresh_tensors(dtype, tie):
    model = tiny_llama(dtype, tie)
    vocab = model.config.vocab_size
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    buf = torch.full((8, vocab), float("nan"))  # (max_bs, vocab): a graph of 5 writes the first rows
    with torch.no_grad():
        ref = model.compute_logits(hidden)
        got = model.compute_logits(hidden, out=buf[:5])
        assert got.data_ptr() == buf.data_ptr() and got.dtype == torch.float32
        assert torch.equal(buf[:5], ref) and buf[5:].isnan().all()  # bit for bit; other rows untouched
        fb = _decode_batch(model, [7, 1, 12])
        ref = model.forward_logits(fb.input_ids, fb.positions, fb)
        buf.fill_(float("nan"))
        got = model.forward_logits(fb.input_ids, fb.positions, fb, out=buf[:3])
        assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:3], ref) and buf[3:].isnan().all()


def test_skinny_linear_out_with_bias_and_bad_outs():
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(16, 10, bias=True)
    x = torch.randn(3, 16, generator=g)
    with torch.no_grad():
        out = torch.empty(3, 10)
        assert skinny_linear(x, lin, out=out) is out and torch.equal(out, nn.functional.linear(x, lin.weight, lin.bias))
        half = lin.to(torch.bfloat16)
        out32 = torch.empty(3, 10)
        skinny_linear(x.bfloat16(), half, out_dtype=torch.float32, out=out32)
        assert torch.equal(out32, skinny_linear(x.bfloat16(), half, out_dtype=torch.float32))
        with pytest.raises(ValueError, match="linear out must be"):
            skinny_linear(x.bfloat16(), half, out_dtype=torch.float32, out=torch.empty(2, 10))  # rows
        with pytest.raises(ValueError, match="linear out must be"):
            skinny_linear(x.bfloat16(), half, out_dtype=torch.float32, out=torch.empty(3, 10, dtype=torch.bfloat16))
        model = tiny_llama(torch.float32)
        with pytest.raises(ValueError, match="float32"):
            model.compute_logits(torch.randn(2, 64), out=torch.empty(2, 300, dtype=torch.bfloat16))


def test_gemv_writes_into_a_row_of_a_larger_buffer():
    from plait.runtime.kernels.gemv import gemv  # imported here: conftest chose the interpreter first

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 40, generator=g).half()
    w = torch.randn(23, 40, generator=g).half()
    ref = gemv(x, w, out_dtype=torch.float32)
    buf = torch.full((3, 23), float("nan"))
    got = gemv(x, w, out_dtype=torch.float32, out=buf[1:2])
    assert got.data_ptr() == buf[1:2].data_ptr() and torch.equal(buf[1:2], ref)
    assert buf[0].isnan().all() and buf[2].isnan().all()
    with pytest.raises(ValueError, match="gemv out must be"):
        gemv(x, w, out_dtype=torch.float32, out=torch.empty(1, 22))
    with pytest.raises(ValueError, match="gemv out must be"):
        gemv(x, w, out_dtype=torch.float32, out=torch.empty(1, 23, dtype=torch.float16))


# ---------------------------------------------------------------- graph runner (GPU)

VOCAB = 128256  # Llama 3's: the size where one logits tensor per graph cost ~9 GB at max_bs 1,024
MAX_BS = 256


def _model_runner(tmp_path, heads: int = 4, kv_heads: int = 2, **server_args):
    from plait.runtime.executor.model_runner import ModelRunner
    from plait.runtime.server_args import ServerArgs

    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=64,
                vocab_size=VOCAB,
                rms_norm_eps=1e-5,
                max_position_embeddings=2048,
                tie_word_embeddings=False,
            )
        )
    )
    sa = ServerArgs(
        model_path=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        attention_backend="triton",
        max_total_tokens=40000,
        max_running_requests=MAX_BS,
        context_length=1024,
        disable_cuda_graph=True,
        **server_args,
    )  # the test captures them itself
    return ModelRunner(sa, str(folder))


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    from plait.runtime.executor.cuda_graphs import CudaGraphRunner, capture_batch_sizes

    mr = _model_runner(tmp_path_factory.mktemp("variants"), cuda_graph_max_bs=MAX_BS)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    runner = CudaGraphRunner(mr.model, mr.memory, mr.info.vocab_size, MAX_BS)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    sizes = capture_batch_sizes(MAX_BS)
    print(
        f"\ncaptured {len(runner.graphs)} graphs in {runner.capture_seconds:.2f} s; "
        f"allocated +{held / 2**20:.0f} MiB (logits buffer {MAX_BS * VOCAB * 4 / 2**20:.0f} MiB)"
    )
    return mr, runner, sizes, held


@pytest.mark.gpu
def test_gpu_graphs_keep_one_logits_buffer(captured):
    mr, runner, sizes, held = captured
    assert runner.cascade_sizes == {bs for bs in sizes if bs >= 16}
    assert runner.ragged_sizes == {bs for bs in sizes if bs >= 8}
    assert len(runner.graphs) == len(sizes) + len(runner.cascade_sizes) + len(runner.ragged_sizes)
    one = MAX_BS * VOCAB * 4
    # A (bs, vocab) float32 output kept per graph would hold sum(bs) rows over both variants: ~17x one
    # buffer here. Shared, it is one buffer plus static inputs, tables and (bs,) greedy ids.
    per_graph = sum(k.batch_size for k in runner.graphs) * VOCAB * 4
    assert per_graph > 8 * one
    assert held < 2 * one, f"graphs hold {held / 2**20:.0f} MiB, one logits buffer is {one / 2**20:.0f} MiB"


def _decode_fb(mr, rows: list[int], rows_slots: list[np.ndarray], seed: int) -> ForwardBatch:
    """A decode batch whose requests' rows hold the given slots (the last one: the new token's).

    NOTE: a row's prefix may only change across an EXTEND step (the cascade planner caches groups by
    rows until one runs), so each batch here writes rows no earlier batch used."""
    g = torch.Generator().manual_seed(seed)
    for row, slots in zip(rows, rows_slots):
        mr.req_to_token_pool.write(row, 0, torch.from_numpy(slots))
    lens = [len(s) for s in rows_slots]
    dev = mr.info.device
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(rows),
        input_ids=torch.randint(0, VOCAB, (len(rows),), generator=g).to(dev),
        positions=torch.tensor(lens, device=dev) - 1,
        req_pool_indices=torch.tensor(rows, device=dev),
        seq_lens=torch.tensor(lens, device=dev),
        out_cache_loc=torch.tensor([int(s[-1]) for s in rows_slots], device=dev),
        seq_lens_cpu=lens,
        req_to_token_pool=mr.req_to_token_pool,
        kv_pool=mr.memory.kv_pool,
        attn_backend=mr.memory.attn_backend,
        req_pool_indices_cpu=np.asarray(rows, dtype=np.int64),
    )


@pytest.mark.gpu
def test_gpu_replay_picks_the_cascade_graph_only_for_shared_prefixes(captured):
    mr, runner, _, _ = captured
    for buf in mr.memory.kv_pool.k_buffer + mr.memory.kv_pool.v_buffer:
        buf.normal_()
    rng = np.random.default_rng(0)
    prefix = np.arange(1, 601, dtype=np.int32)  # 600 slots every request of the first batch shares
    at = 601
    shared, solo = [], []
    for _ in range(40):
        own = int(rng.integers(2, 40))
        shared.append(np.concatenate([prefix, np.arange(at, at + own, dtype=np.int32)]))
        at += own
    for _ in range(40):
        n = int(rng.integers(300, 700))
        solo.append(np.arange(at, at + n, dtype=np.int32))
        at += n
    cases = [
        (range(1, 41), shared, True),
        (range(41, 81), solo, False),
        (range(81, 86), shared[:5], False),
    ]  # 5 requests: the graph of 8, which has no cascade variant
    for rows, batch, cascade in cases:
        fb = _decode_fb(mr, list(rows), batch, seed=len(batch))
        counts = (runner.plain_replays, runner.cascade_replays)
        with torch.inference_mode():  # as the model runner calls it
            logits, greedy = runner.replay(fb)
            logits, greedy = logits.clone(), greedy.clone()
            mr.memory.attn_backend.init_forward_metadata(fb)  # eager: the same attention, cascade or not
            ref = mr.model.compute_logits(mr.model(fb.input_ids, fb.positions, fb))
        ran = (runner.plain_replays - counts[0], runner.cascade_replays - counts[1])
        assert ran == ((0, 1) if cascade else (1, 0))
        assert torch.equal(greedy, logits.argmax(-1))
        # bf16 activations, and the graph's padded batch splits the KV differently: close, not equal.
        assert float((logits - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.gpu
def test_gpu_disabled_cascade_captures_plain_graphs_only(tmp_path):
    from plait.runtime.executor.cuda_graphs import CudaGraphRunner

    mr = _model_runner(tmp_path, cuda_graph_max_bs=32, disable_cascade_attention=True)
    runner = CudaGraphRunner(mr.model, mr.memory, mr.info.vocab_size, 32)
    assert runner.cascade_sizes == frozenset()
    assert sorted(k.batch_size for k in runner.graphs if not k.ragged) == [1, 2, 4, 8, 16, 32]
    assert not any(k.cascade for k in runner.graphs)


@pytest.mark.gpu
def test_gpu_replay_picks_the_ragged_graph_for_a_long_request_among_short_ones(tmp_path):
    # A batch of about one length replays the plain graph (even splits); one with two long requests among
    # short ones the ragged variant (the split plan's kernels). Both against the eager step.
    from plait.runtime.executor.cuda_graphs import CudaGraphRunner

    mr = _model_runner(tmp_path, heads=8, kv_heads=8, cuda_graph_max_bs=80, disable_cascade_attention=True)
    runner = CudaGraphRunner(mr.model, mr.memory, mr.info.vocab_size, 80)
    assert GraphKey(80, False, ragged=True) in runner.graphs and GraphKey(4, False, ragged=True) not in runner.graphs
    for buf in mr.memory.kv_pool.k_buffer + mr.memory.kv_pool.v_buffer:
        buf.normal_()
    rng = np.random.default_rng(1)
    at, even, ragged = 1, [], []  # ~20,000 slots of the pool's 40,000; rows of at most 1,024 (the context)
    for batch, lens in ((even, rng.integers(150, 250, 72)), (ragged, [60] * 70 + [1000, 900])):
        for n in lens:
            batch.append(np.arange(at, at + int(n), dtype=np.int32))
            at += int(n)
    for rows, batch, uneven in ((range(1, 73), even, False), (range(73, 145), ragged, True)):
        fb = _decode_fb(mr, list(rows), batch, seed=len(batch))
        before = (runner.plain_replays, runner.ragged_replays)
        with torch.inference_mode():
            logits, greedy = runner.replay(fb)
            logits, greedy = logits.clone(), greedy.clone()
            mr.memory.attn_backend.init_forward_metadata(fb)
            ref = mr.model.compute_logits(mr.model(fb.input_ids, fb.positions, fb))
        assert (runner.plain_replays - before[0], runner.ragged_replays - before[1]) == (1, int(uneven))
        assert torch.equal(greedy, logits.argmax(-1))
        assert float((logits - ref).norm() / ref.norm()) < 2e-2
