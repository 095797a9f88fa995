"""The pieces of a split model that need no second process: which shapes split (and the errors naming
the numbers), which heads and rows each rank holds, what each rank reads of a real safetensors file
(its slices put back together are the whole tensor), micro-batches of a step, the req_to_token writes
rank 0 records and the others replay, the rank layout. End to end: tests/parallel/test_parallel.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.model_folders import make_folder
from plait.runtime.distributed.pipeline import split_micro_batches
from plait.runtime.distributed.topology import Rendezvous, Topology
from plait.runtime.forward_batch import ForwardMode
from plait.runtime.kvcache.memory_pool import ReqToTokenPool
from plait.runtime.models.config import BUILTIN_SHAPES, ModelConfig
from plait.runtime.models.parallel import (
    ModelParallel,
    PipelineStage,
    TensorParallel,
    check_parallel_shape,
    checkpoint_read,
    read_slice,
    shard_heads,
    vocab_shard,
)
from plait.runtime.step import StepInput
from safetensors import safe_open


def smollm() -> ModelConfig:
    return ModelConfig.from_dict(BUILTIN_SHAPES["smollm2-135m"])  # 9 heads, 3 KV heads, 30 layers


def test_shapes_that_do_not_split_are_refused_naming_the_numbers():
    cfg = smollm()
    check_parallel_shape(cfg, 3)
    with pytest.raises(ValueError, match="tp_size 9 does not divide the model's intermediate_size 1536"):
        check_parallel_shape(cfg, 9)  # (the heads would: 1 query head per rank, each KV head on 3 ranks)
    check_parallel_shape(cfg, 1, pp_size=30)
    with pytest.raises(ValueError, match=r"tp_size 2 does not divide the model's num_attention_heads 9 .*\(1, 3, 9\)"):
        check_parallel_shape(cfg, 2)
    with pytest.raises(ValueError, match="pp_size 31 is above the model's num_hidden_layers 30"):
        check_parallel_shape(cfg, 1, pp_size=31)
    eight = ModelConfig.from_dict(BUILTIN_SHAPES["llama-3.1-8b"])  # 32 heads, 8 KV heads
    check_parallel_shape(eight, 2)
    check_parallel_shape(eight, 16)  # KV heads replicated twice
    gqa = ModelConfig.from_dict({**BUILTIN_SHAPES["llama-3.1-8b"], "num_attention_heads": 24, "num_key_value_heads": 6})
    with pytest.raises(ValueError, match="tp_size 4 does not divide the model's num_key_value_heads 6"):
        check_parallel_shape(gqa, 4)
    with pytest.raises(ValueError, match="tp_size 12 is above the model's num_key_value_heads 8 and not a multiple"):
        check_parallel_shape(ModelConfig.from_dict({**gqa.raw, "num_key_value_heads": 8}), 12)


def test_heads_and_vocabulary_rows_per_rank():
    eight = ModelConfig.from_dict(BUILTIN_SHAPES["llama-3.1-8b"])
    shards = [shard_heads(eight, TensorParallel(r, 16)) for r in range(16)]
    assert {(s.num_heads, s.num_kv_heads) for s in shards} == {(2, 1)}
    # Query heads 2r, 2r + 1 read KV head (2r) // 4 (4 query heads per KV head): ranks 2k, 2k + 1 hold KV head k.
    assert [s.first_kv_head for s in shards] == [r // 2 for r in range(16)]
    assert [s.first_head // 4 for s in shards] == [s.first_kv_head for s in shards]
    two = [shard_heads(eight, TensorParallel(r, 2)) for r in range(2)]
    assert [(s.num_heads, s.num_kv_heads, s.first_head, s.first_kv_head) for s in two] == [
        (16, 4, 0, 0),
        (16, 4, 16, 4),
    ]
    assert [vocab_shard(320, TensorParallel(r, 3)) for r in range(3)] == [
        (0, 107, 107),
        (107, 107, 107),
        (214, 107, 106),
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    # 6 heads / 3 KV heads (sharded at TP = 3; a vocabulary of 320 split 107 + 107 + 106), and one KV head
    # for 4 query heads (replicated at TP = 2).
    folders = {
        "kv3": make_folder(
            root / "kv3",
            "qwen2",
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=6,
            num_key_value_heads=3,
            num_hidden_layers=3,
        ),
        "kv1": make_folder(root / "kv1", "llama", num_key_value_heads=1, attention_bias=True),
    }
    return {k: (f, ModelConfig.from_path(f)) for k, f in folders.items()}


@pytest.mark.parametrize("which,tp", [("kv3", 3), ("kv1", 2)])
def test_each_rank_reads_its_slices_and_they_make_the_whole(checkpoints, which, tp):
    folder, cfg = checkpoints[which]
    with safe_open(f"{folder}/model.safetensors", framework="pt") as st:
        for name in st.keys():
            whole = st.get_tensor(name)
            reads = [checkpoint_read(name, cfg, ModelParallel(tp=TensorParallel(r, tp))) for r in range(tp)]
            parts = [read_slice(st, name, read) for read in reads if read is not None]
            if name.endswith("o_proj.bias"):  # row-parallel: rank 0 alone adds it
                assert [r is not None for r in reads] == [True] + [False] * (tp - 1)
                continue
            dims = {read.dim for read in reads}
            replicated = dims == {None} or (cfg.num_key_value_heads < tp and ("k_proj" in name or "v_proj" in name))
            if replicated:  # norms; a KV head fewer than the ranks: each rank a copy
                assert all(torch.equal(p, whole) for p in parts), name
                continue
            (dim,) = dims
            assert torch.equal(torch.cat(parts, dim), whole), name
            assert reads[0].name == name.removeprefix("model.")


def test_a_pipeline_stage_reads_only_its_layers(checkpoints):
    folder, cfg = checkpoints["kv3"]
    stages = [PipelineStage.of(s, 2, cfg.num_hidden_layers) for s in range(2)]
    assert [(s.first_layer, s.num_layers) for s in stages] == [(0, 1), (1, 2)]  # the first also holds the head
    with safe_open(f"{folder}/model.safetensors", framework="pt") as st:
        names = list(st.keys())
    held = [
        {r.name for n in names if (r := checkpoint_read(n, cfg, ModelParallel(stage=s))) is not None} for s in stages
    ]
    assert "embed_tokens.weight" in held[0] and "embed_tokens.weight" not in held[1]
    assert "norm.weight" in held[1] and "norm.weight" not in held[0]
    assert {n.split(".")[1] for n in held[0] if n.startswith("layers.")} == {"0"}
    assert {n.split(".")[1] for n in held[1] if n.startswith("layers.")} == {"0", "1"}  # local indices


def test_micro_batches_cover_the_step_in_order():
    ids = list(range(100, 100 + 30))
    step = StepInput.extend([4, 2, 7, 1], [0, 5, 0, 2], [10, 3, 12, 5], ids, np.arange(1, 31))
    parts = split_micro_batches(step, 2)
    assert [p.batch_size for p in parts] == [2, 2]  # 13 and 17 tokens: the split nearest the middle
    assert np.array_equal(np.concatenate([p.token_rows for p in parts], 1), step.token_rows)
    for p in parts:
        assert p.req_rows[4, 0] == 0 and p.num_tokens == int(p.req_rows[3].sum())
        assert np.array_equal(p.kv_writes[2], p.token_rows[2])
    assert split_micro_batches(step, 8)[3].req_rows[0].tolist() == [1]  # at most one request each
    decode = StepInput(
        ForwardMode.DECODE, 5, np.arange(25).reshape(5, 5), [3] * 5, (np.arange(5), np.arange(5), np.arange(5))
    )
    halves = split_micro_batches(decode, 2)
    assert [h.batch_size for h in halves] == [2, 3]
    assert np.array_equal(np.concatenate([h.token_rows for h in halves], 1), decode.token_rows)


def test_table_writes_recorded_on_rank_0_rebuild_the_same_table_elsewhere():
    rank0 = ReqToTokenPool(4, 16, "cpu", record_writes=True)
    other = ReqToTokenPool(4, 16, "cpu")
    shared = torch.tensor([5, 6, 7])
    rank0.write_rows([(1, shared), (2, shared), (3, torch.tensor([9]))])
    rank0.write(2, 3, torch.tensor([11, 12]))
    writes = rank0.take_writes()
    assert rank0.take_writes() == []
    other.replay_writes(writes)
    assert np.array_equal(other.host, rank0.host)
    assert torch.equal(other.req_to_token, rank0.req_to_token)
    assert other.host[2, :5].tolist() == [5, 6, 7, 11, 12]


def test_rank_layout_and_torchrun_environment():
    topo = Topology(tp_size=2, pp_size=2, nnodes=2, node_rank=1)
    assert list(topo.node_ranks()) == [2, 3] and topo.local_rank(3) == 1
    assert [topo.stage_of(r) for r in range(4)] == [0, 0, 1, 1] and topo.peer(1, 1) == 3
    env = Rendezvous("10.0.0.1", 29500).rank_env(topo, 3)
    assert env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
