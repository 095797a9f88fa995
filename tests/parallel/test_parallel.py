"""Tensor and pipeline parallelism on the CPU: each rank its own process, gloo over loopback, the real
scheduler and engine on rank 0. A model split over ranks must give what one device gives: the same
greedy tokens, logprobs within float noise (the partial sums of a split matmul add in another order),
the same constrained and seeded-sampled outputs, prefix-cache hits, and no process left behind.

The references: a one-device Engine on the same folder (TP = 1) where the comparison is between
engines, else Hugging Face transformers, which the one-device engine matches token for token
(tests/models/test_correctness_vs_hf.py).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from conftest import free_port, hf_greedy
from helpers.model_folders import EOS, build_tokenizer, make_folder
from helpers.spec_models import write_eagle_head
from plait.runtime import Engine
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.timeout(600)

SMALL = dict(num_threads=1, max_total_tokens=4096, chunked_prefill_size=24)
SHARED = "the quick brown fox jumps over the lazy dog and "
PROMPTS = [SHARED + "hello there", SHARED + "how are you today?", "be brief and kind", SHARED * 3 + "system"]
ID_PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 26, 27, 28]]


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


class Ranks:
    """An engine and its rank processes (the scheduler's children), checked gone after shutdown."""

    def __init__(self, engine: Engine, expected_children: int):
        self.engine = engine
        self.pids = [engine._proc.pid, *children_of(engine._proc.pid)]
        assert len(self.pids) == 1 + expected_children, self.pids

    def shutdown(self) -> None:
        self.engine.shutdown()
        deadline = time.time() + 30
        while any(alive(p) for p in self.pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in self.pids if alive(p)], "rank processes outlived the engine"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_models")
    tok = build_tokenizer()
    folders = {
        # 4 query heads, 2 KV heads: at TP = 2 each rank 2 + 1.
        "llama": make_folder(root / "llama", "llama", tokenizer=tok, max_position_embeddings=512),
        # 6 heads / 3 KV heads / 192 MLP columns at TP = 3; a vocabulary of 320 = 107 + 107 + 106 rows.
        "qwen2": make_folder(
            root / "qwen2",
            "qwen2",
            tokenizer=tok,
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=6,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        ),
        # One KV head for 4 query heads: at TP = 2 both ranks hold (a copy of) it.
        "qwen3": make_folder(root / "qwen3", "qwen3", tokenizer=tok, num_key_value_heads=1, head_dim=16),
        # A draft model for "llama": its tokenizer, another (one-layer) network, so most drafts are wrong.
        "llama draft": make_folder(
            root / "llama_draft", "llama", tokenizer=tok, num_hidden_layers=1, max_position_embeddings=512
        ),
    }
    folders["llama eagle"] = write_eagle_head(str(root / "eagle"), folders["llama"], "EAGLE", seed=2)
    folders["llama eagle3"] = write_eagle_head(
        str(root / "eagle3"), folders["llama"], "EAGLE3", seed=3, draft_vocab=128
    )
    return folders


@pytest.fixture(scope="module")
def llama_engines(folders):
    one = Engine(folders["llama"], **SMALL)
    two = Ranks(Engine(folders["llama"], tp_size=2, **SMALL), expected_children=1)
    try:
        yield one, two.engine
    finally:
        one.shutdown()
        two.shutdown()


def greedy(n: int, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **extra}


def run_workload(engine: Engine) -> dict:
    """A little of everything the scheduler does on top of the step: batched prompts sharing a prefix
    (in-batch dedup, then cache hits), chunked prefill, logprobs, a regex, seeded sampling."""
    first = engine.generate(PROMPTS, greedy(12), return_logprob=True, top_logprobs_num=3)
    again = engine.generate(PROMPTS[:2], greedy(6))  # their prefixes are cached now
    ids = engine.generate(input_ids=ID_PROMPTS, sampling_params=greedy(10, ignore_eos=True))
    regex = engine.generate("the answer is", greedy(12, regex=r"(yes|no), [a-z]{2,6}\."))
    seeded = engine.generate(PROMPTS[:2], {"max_new_tokens": 10, "temperature": 0.9, "seed": 7})
    assert engine.check_integrity()
    return {"first": first, "again": again, "ids": ids, "regex": regex, "seeded": seeded}


def assert_same_outputs(got: dict, want: dict) -> None:
    for name in ("first", "again", "ids", "seeded"):
        assert [o["output_ids"] for o in got[name]] == [o["output_ids"] for o in want[name]], name
    assert got["regex"]["text"] == want["regex"]["text"]
    for g, w in zip(got["first"], want["first"]):
        lp_g = torch.tensor([lp for lp, _, _ in g["meta_info"]["output_token_logprobs"]])
        lp_w = torch.tensor([lp for lp, _, _ in w["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(lp_g, lp_w, atol=1e-4, rtol=1e-4)
        top_g = [[t for _, t, _ in step] for step in g["meta_info"]["output_top_logprobs"]]
        top_w = [[t for _, t, _ in step] for step in w["meta_info"]["output_top_logprobs"]]
        assert top_g == top_w


@pytest.fixture(scope="module")
def one_device_outputs(llama_engines):
    return run_workload(llama_engines[0])


def test_tp2_gives_what_one_device_gives(llama_engines, one_device_outputs):
    got = run_workload(llama_engines[1])
    assert_same_outputs(got, one_device_outputs)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in got["again"])  # the radix cache on rank 0 works
    assert got["regex"]["text"].split(",")[0] in ("yes", "no")
    info = llama_engines[1].get_server_info()
    assert info["tp_size"] == 2 and info["max_total_tokens"] == 4096


@pytest.mark.parametrize(
    "algo, draft, shape",
    [
        ("NGRAM", None, {}),
        ("STANDALONE", "llama", {}),  # the target as its own draft: nearly every draft accepted
        (
            "STANDALONE",
            "llama draft",
            dict(speculative_eagle_topk=2, speculative_num_steps=3, speculative_num_draft_tokens=6),
        ),
        (
            "EAGLE",
            "llama eagle",
            dict(speculative_eagle_topk=2, speculative_num_steps=2, speculative_num_draft_tokens=4),
        ),
        ("EAGLE3", "llama eagle3", {}),
    ],
    ids=["ngram", "standalone self chain", "standalone other tree", "eagle tree", "eagle3 chain"],
)
def test_tp2_with_speculation_gives_what_one_device_gives(folders, one_device_outputs, algo, draft, shape):
    # Every rank runs the VERIFY steps rank 0 plans (Follower.follow). A drafter runs whole on rank 0
    # beside its shard (an EAGLE head with rank 0's whole copy of the embedding and LM head). Greedy outputs
    # and logprobs as one device without speculation; grammar drafts off, so that the regex request jumps
    # forward as there (with them its output is plain constrained decoding's, which jump-forward's
    # retokenizing can differ from).
    ranks = Ranks(
        Engine(
            folders["llama"],
            tp_size=2,
            speculative_algorithm=algo,
            speculative_draft_model_path=folders[draft] if draft else None,
            speculative_grammar_drafts="off",
            **shape,
            **SMALL,
        ),
        expected_children=1,
    )
    try:
        got = run_workload(ranks.engine)
        stats = ranks.engine.get_stats()
    finally:
        ranks.shutdown()
    assert_same_outputs(got, one_device_outputs)
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    if draft == "llama":
        assert stats["spec_accepted_tokens"] > 0.5 * stats["spec_draft_tokens"], stats


def test_pp2_gives_what_one_device_gives(folders, one_device_outputs):
    pp = Ranks(Engine(folders["llama"], pp_size=2, **SMALL), expected_children=1)
    try:
        got = run_workload(pp.engine)
    finally:
        pp.shutdown()
    assert_same_outputs(got, one_device_outputs)


def hf_reference(folder: str, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens and the logprobs of those tokens, per prompt."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs, lps = [], []
    for p in prompts:
        out = hf_greedy(hf, p, n, eos_ids=[EOS])
        with torch.no_grad():
            logits = hf(torch.tensor([p + out])).logits[0, len(p) - 1 : len(p) - 1 + len(out)]
        lps.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None])[:, 0])
        outs.append(out)
    return outs, lps


def assert_matches_hf(engine: Engine, folder: str) -> None:
    want, want_lp = hf_reference(folder, ID_PROMPTS, 12)
    outs = engine.generate(input_ids=ID_PROMPTS, sampling_params=greedy(12), return_logprob=True)
    assert [o["output_ids"] for o in outs] == want
    for o, lp in zip(outs, want_lp):
        got = torch.tensor([x for x, _, _ in o["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, lp, atol=1e-4, rtol=1e-4)


def test_tp3_with_an_uneven_vocabulary_shard(folders):
    ranks = Ranks(Engine(folders["qwen2"], tp_size=3, **SMALL), expected_children=2)
    try:
        assert_matches_hf(ranks.engine, folders["qwen2"])
    finally:
        ranks.shutdown()


def test_tp2_by_pp2(folders):
    """Four ranks: two stages of two tensor-parallel ranks each (the first stage's pair computes the
    LM head's halves while rank 0 samples)."""
    ranks = Ranks(Engine(folders["llama"], tp_size=2, pp_size=2, **SMALL), expected_children=3)
    try:
        assert_matches_hf(ranks.engine, folders["llama"])
    finally:
        ranks.shutdown()


def test_tp2_over_two_nodes_with_a_replicated_kv_head(folders, tmp_path):
    """nnodes = 2 on one machine: node 0 is this engine (rank 0), node 1 is `plait serve --node-rank 1`
    (rank 1), meeting at --dist-init-addr over loopback, as two machines would."""
    addr = f"127.0.0.1:{free_port()}"
    flags = [
        "--model-path",
        folders["qwen3"],
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        addr,
        "--num-threads",
        "1",
        "--max-total-tokens",
        "4096",
    ]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "plait.runtime.server", *flags, "--node-rank", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        engine = Engine(folders["qwen3"], tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **SMALL)
        try:
            assert_matches_hf(engine, folders["qwen3"])
        finally:
            engine.shutdown()
        assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "standalone draft"])
def test_default_model_at_tp3(hf_default_model, default_tokenizer, default_model_path, drafts):
    # Real weights split three ways, alone and with a STANDALONE draft model (the model itself, whole on
    # rank 0): transformers' greedy tokens either way.
    prompts = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,"]
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=default_model_path) if drafts else {}
    ranks = Ranks(Engine(tp_size=3, num_threads=1, max_total_tokens=4096, **spec), expected_children=2)
    try:
        outs = ranks.engine.generate(prompts, greedy(16))
        stats = ranks.engine.get_stats()
    finally:
        ranks.shutdown()
    for prompt, out in zip(prompts, outs):
        ids = default_tokenizer.encode(prompt)
        assert out["output_ids"] == hf_greedy(hf_default_model, ids, 16, eos_ids=[default_tokenizer.eos_token_id])
    assert (stats["spec_accepted_tokens"] > 0) == drafts, stats


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(folders):
    with pytest.raises(ValueError, match=r"tp_size 2 does not divide the model's num_attention_heads 9"):
        Engine(tp_size=2)  # the default model: 9 heads, 3 KV heads
    with pytest.raises(ValueError, match=r"tp_size 4 does not divide the model's num_attention_heads 6"):
        Engine(folders["qwen2"], tp_size=4)
