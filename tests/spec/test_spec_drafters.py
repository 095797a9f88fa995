"""Drafts from a model: STANDALONE (a draft model with its own paged KV) and EAGLE / EAGLE-3 heads (read the
target's hidden states), chains and top-k trees, on small random models (tests/helpers/spec_models.py) in
in-process schedulers. Greedy outputs are token for token those without speculation, whatever the
drafts (a draft model that is the target itself has every chain accepted; random heads almost none),
batched, with the radix cache hit on a second round, chunked prefill and a pool that retracts; the
integrity check runs after every step. Drafters that cannot draft for the target are refused at start-up.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import make_random_model
from helpers.scheduler_loop import run_until_idle
from helpers.spec_models import write_eagle_head
from plait.runtime.io_struct import TokenizedGenerateReq
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import create_scheduler
from plait.runtime.server_args import ServerArgs


@pytest.fixture(scope="module")
def folders(tmp_path_factory, random_models):
    root = tmp_path_factory.mktemp("drafters")
    target = random_models["llama"]
    return {
        "target": target,
        "other": make_random_model(str(root / "other"), "llama", seed=1),
        "eagle": write_eagle_head(str(root / "eagle"), target, "EAGLE", seed=2),
        "eagle3": write_eagle_head(str(root / "eagle3"), target, "EAGLE3", seed=3, draft_vocab=128),
        "root": str(root),
    }


PROMPTS = [
    [3, 17, 22, 9, 40, 3, 17, 22],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
    [100, 101, 2, 2, 2],
    list(range(30, 70)),
]


def reqs(n_new: int = 20, prompts=PROMPTS):
    return [(f"r{i}", p, dict(max_new_tokens=n_new, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]


def run(s, requests) -> dict:
    for rid, ids, sp in requests:
        s.handle_message(TokenizedGenerateReq(list(ids), SamplingParams(**sp), RequestOptions(rid=rid)))
    return run_until_idle(s, 1000)


def scheduler(path: str, **kw):
    kw.setdefault("max_total_tokens", 4096)
    return create_scheduler(ServerArgs(model_path=path, device="cpu", **kw), path)


@pytest.fixture(scope="module")
def reference(folders):
    s = scheduler(folders["target"])
    return {"batch": run(s, reqs()), "alone": {rid: run(s, [r])[rid] for r in reqs() for rid in [r[0]]}}


DRAFTERS = {
    "standalone self chain": ("STANDALONE", "target", {}),
    "standalone other chain": ("STANDALONE", "other", {}),
    "standalone self tree": (
        "STANDALONE",
        "target",
        dict(speculative_eagle_topk=2, speculative_num_steps=3, speculative_num_draft_tokens=6),
    ),
    "eagle chain": ("EAGLE", "eagle", {}),
    "eagle tree": (
        "EAGLE",
        "eagle",
        dict(speculative_eagle_topk=3, speculative_num_steps=3, speculative_num_draft_tokens=8),
    ),
    "eagle3 chain": ("EAGLE3", "eagle3", {}),
    "eagle3 tree": (
        "EAGLE3",
        "eagle3",
        dict(speculative_eagle_topk=2, speculative_num_steps=2, speculative_num_draft_tokens=5),
    ),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_outputs_match_alone_batched_and_from_the_cache(name, folders, reference):
    algo, draft, extra = DRAFTERS[name]
    s = scheduler(folders["target"], speculative_algorithm=algo, speculative_draft_model_path=folders[draft], **extra)
    assert run(s, reqs()) == reference["batch"]
    for r in reqs()[:2]:
        assert run(s, [r]) == {r[0]: reference["alone"][r[0]]}
    cached = s.get_stats()["cached_tokens"]
    assert run(s, reqs()) == reference["batch"]  # a second round: every prompt is in the radix cache
    st = s.get_stats()
    assert st["cached_tokens"] > cached and st["spec_verify_steps"] > 0
    if name == "standalone self chain":  # the draft is the target: every draft is accepted
        assert st["spec_accepted_tokens"] == st["spec_draft_tokens"]
        assert st["avg_spec_accept_length"] > 3


@pytest.mark.parametrize("name", ["standalone self tree", "eagle3 tree"])
def test_chunked_prefill_and_retraction_with_a_drafter(name, folders, reference):
    algo, draft, extra = DRAFTERS[name]
    s = scheduler(
        folders["target"],
        speculative_algorithm=algo,
        speculative_draft_model_path=folders[draft],
        chunked_prefill_size=16,
        max_total_tokens=100,
        disable_radix_cache=True,
        **extra,
    )
    assert run(s, reqs()) == reference["batch"]
    assert s.get_stats()["num_retractions"] > 0


def _copy_with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def _write_word_tokenizer(folder: str, vocab: dict) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}, f)


def test_drafters_that_cannot_draft_for_the_target_are_refused_at_start_up(folders):
    root, target = folders["root"], folders["target"]
    big = make_random_model(os.path.join(root, "big_vocab"), "llama", seed=4)
    _copy_with_config(big, os.path.join(root, "vocab300"), vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 256"):
        scheduler(
            target, speculative_algorithm="STANDALONE", speculative_draft_model_path=os.path.join(root, "vocab300")
        )
    # the same vocabulary size, another tokenizer
    words = {f"w{i}": i for i in range(255)} | {"<unk>": 255}
    t2, d2 = shutil.copytree(target, os.path.join(root, "t_tok")), shutil.copytree(target, os.path.join(root, "d_tok"))
    _write_word_tokenizer(t2, words)
    _write_word_tokenizer(d2, {f"v{i}": i for i in range(255)} | {"<unk>": 255})
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        scheduler(t2, speculative_algorithm="STANDALONE", speculative_draft_model_path=d2)
    with pytest.raises(ValueError, match="is an EAGLE3 head"):
        scheduler(target, speculative_algorithm="EAGLE", speculative_draft_model_path=folders["eagle3"])
    wide = _copy_with_config(folders["eagle"], os.path.join(root, "eagle_wide"), hidden_size=128)
    with pytest.raises(ValueError, match="reads hidden states of size 128"):
        scheduler(target, speculative_algorithm="EAGLE", speculative_draft_model_path=wide)
    with pytest.raises(ValueError, match="is not a folder"):
        scheduler(target, speculative_algorithm="EAGLE", speculative_draft_model_path=os.path.join(root, "nope"))


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_eagle_lockstep_state_is_the_head_over_the_whole_sequence(kind, folders):
    """The head's state after a prefill and a verify step (incremental, one token behind the target) equals
    the head run once over the whole sequence's (next token, feature) pairs: the shift by one, the
    features of the kept path's nodes and the positions line up."""
    import numpy as np
    import torch
    from plait.runtime.attention import AttentionContext
    from plait.runtime.attention.torch_native import TorchNativeAttnBackend
    from plait.runtime.executor.spec_runner import _load_head
    from plait.runtime.executor.staging import HostStaging
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool
    from plait.runtime.models.config import ModelConfig
    from plait.runtime.speculative.draft_batch import DraftMemory
    from plait.runtime.speculative.eagle import EagleDrafter
    from plait.runtime.speculative.eagle_head import HeadConfig
    from plait.runtime.speculative.tree import DraftTree
    from plait.runtime.speculative.verify_step import build_verify_step
    from plait.runtime.step import StepInput, StepOutput, VerifiedTokens

    target_cfg = ModelConfig.from_path(folders["target"])
    hc = HeadConfig.from_folder(folders[kind.lower()], kind, target_cfg)
    head = _load_head(hc, folders[kind.lower()], torch.float32, "cpu", 512)
    head.embed_tokens = torch.nn.Embedding(256, 64)  # a head with its own embedding (the target's is not here)
    head._target_logits = lambda h: h @ torch.randn(256, 64, generator=torch.Generator().manual_seed(5)).T

    def drafter():
        pool = KVPool(200, head.num_kv_layers, hc.model.num_key_value_heads, hc.model.head_dim, torch.float32, "cpu")
        mem = DraftMemory(
            pool,
            ReqToTokenPool(4, 128, "cpu"),
            TorchNativeAttnBackend(AttentionContext("cpu")),
            150,
            EagleDrafter.scratch_per_row(3, 1),
            "cpu",
            HostStaging("cpu"),
        )
        return EagleDrafter(head, mem, 3, 1, 4, 4)

    g = torch.Generator().manual_seed(0)
    width = 64 if kind == "EAGLE" else 3 * 64
    prompt, row = [5, 9, 30, 31, 7, 2], 2
    P = len(prompt)

    def fb_of(features):  # what the target's forward would hand the drafter
        return type("FB", (), {"captured_hidden": [features[:, i * 64 : (i + 1) * 64] for i in range(3)]})()

    def hidden_of(features):
        return features if kind == "EAGLE" else None

    # incremental: a prefill (sampling token 40), then a verify step whose tree keeps root -> 41 -> 42 (+ bonus 43)
    d = drafter()
    feats1 = torch.randn(P, width, generator=g)
    step = StepInput.extend([row], [0], [P], prompt, np.arange(1, P + 1))
    d.mem.req_to_token.write_step(tuple(torch.from_numpy(a) for a in step.kv_writes), step.kv_writes)
    step.sampling_reqs, step.following_ids = [0], [-1]
    d.observe(step, StepOutput([40]), hidden_of(feats1), fb_of(feats1))
    tree = DraftTree([40, 41, 50, 42], [-1, 0, 0, 1])  # root 40; 41 -> 42 is the kept path
    vstep = build_verify_step([row], [P], [tree], np.arange(P + 1, P + 5))
    d.mem.req_to_token.write_step(tuple(torch.from_numpy(a) for a in vstep.kv_writes), vstep.kv_writes)
    feats2 = torch.randn(4, width, generator=g)
    out = StepOutput([43], verified=[VerifiedTokens([41, 42, 43], [1, 3], proposed=3)])
    d.after_verify(vstep, out, hidden_of(feats2), fb_of(feats2))

    # the whole sequence at once: pairs (x_{t+1}, feature_t) for the prompt, the root 40, 41 and 42
    ref = drafter()
    seq_next = prompt[1:] + [40, 41, 42, 43]
    feats = torch.cat(
        [
            d.feature(hidden_of(feats1), fb_of(feats1)),  # as the drafter reads the target's layers
            d.feature(hidden_of(feats2), fb_of(feats2))[[0, 1, 3]],
        ]
    )  # the kept path: root, 41, 42
    n = len(seq_next)
    slots = np.arange(1, n + 1)
    whole = StepInput.extend([row], [0], [n], seq_next, slots)
    ref.mem.req_to_token.write_step(tuple(torch.from_numpy(a) for a in whole.kv_writes), whole.kv_writes)
    dfb = ref.mem.of_step(whole)
    assert dfb.forward_mode is ForwardMode.EXTEND
    ref._run(dfb.input_ids, feats, dfb, [n - 1], [row])
    torch.testing.assert_close(d.next_feature[row], ref.next_feature[row], atol=1e-4, rtol=1e-4)
    assert d.next_ids[row].tolist() == ref.next_ids[row].tolist()
