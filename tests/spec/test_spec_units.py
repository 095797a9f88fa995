"""Speculative decoding's pieces on their own (prompt lookup: test_ngram.py): draft trees, greedy acceptance, rejection
sampling keeping the target's distribution (many draws, a chi-square bound, a fixed seed), grammar-forced
drafts and grammar masks down a tree with a real xgrammar matcher (the default model's tokenizer), the
verify step's rows, and the settings that cannot work refused at start-up."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from plait.runtime.server_args import ServerArgs
from plait.runtime.speculative.acceptance import accept_greedy, accept_sampled
from plait.runtime.speculative.grammar_drafts import GrammarDrafts, fill_tree_bitmask
from plait.runtime.speculative.tree import DraftTree, merge_chains
from plait.runtime.speculative.verify_step import build_verify_step, step_trees


# ---------------------------------------------------------------- trees and acceptance
def test_trees_masks_and_merged_chains():
    tree = merge_chains(9, [[1, 2, 3], [1, 4], [6]], max_nodes=5)
    assert tree.tokens == [9, 1, 2, 3, 4] and tree.parents == [-1, 0, 1, 2, 1]
    assert tree.depths().tolist() == [0, 1, 2, 3, 2]
    assert tree.ancestor_mask()[4].tolist() == [True, True, False, False, True]
    assert DraftTree.chain(5, [6, 7]).is_chain() and not tree.is_chain()
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])


def test_greedy_acceptance_walks_the_matching_path():
    tree = DraftTree([9, 1, 2, 3, 4], [-1, 0, 1, 0, 3])  # 9 -> 1 -> 2 ; 9 -> 3 -> 4
    # the target's argmax after each node: after 9: 3, after 3: 4, after 4: 7
    assert accept_greedy(tree, [3, 0, 0, 4, 7]) == ([3, 4, 7], [3, 4])
    assert accept_greedy(tree, [5, 0, 0, 0, 0]) == ([5], [])


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """A tree with two children of the root (one with a child of its own) under synthetic targets: the
    first token is distributed as the root's target, the second (after each accepted draft) as that
    draft's target, over 40,000 draws. Bound: chi-square with 5 degrees of freedom below 25.7 (p 1e-4);
    the seed is fixed, so the test is deterministic."""
    V = 6
    g = torch.Generator().manual_seed(1234)
    p_root = torch.tensor([0.30, 0.05, 0.25, 0.0, 0.15, 0.25])
    p_after2 = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])
    p_after0 = torch.tensor([0.05, 0.05, 0.6, 0.1, 0.1, 0.1])
    p_after21 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    tree = DraftTree([7, 2, 0, 1], [-1, 0, 0, 1])  # root -> 2 -> 1 ; root -> 0
    rows = torch.stack([p_root, p_after2, p_after0, p_after21])  # (4, V) per node
    n = 40_000
    probs = rows.repeat(n, 1)  # (4n, V)
    torch.manual_seed(99)
    results = accept_sampled([tree] * n, probs, [4 * i for i in range(n)], generator=g)
    first = np.bincount([toks[0] for toks, _ in results], minlength=V)
    assert _chi2(first, p_root.numpy()) < 25.7
    for tok, p in ((2, p_after2), (0, p_after0)):
        second = np.bincount([toks[1] for toks, _ in results if toks[0] == tok], minlength=V)
        assert _chi2(second, p.numpy()) < 25.7
    third = np.bincount([toks[2] for toks, _ in results if toks[:2] == [2, 1]], minlength=V)
    assert _chi2(third, p_after21.numpy()) < 25.7
    # every accepted draft is reported at its node, and the drafts accepted follow the tree
    for toks, nodes in results:
        assert [tree.tokens[x] for x in nodes] == toks[: len(nodes)]


def test_rejection_sampling_of_a_chain_with_impossible_drafts():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    tree = DraftTree.chain(3, [3])  # the draft has target probability 0: never accepted
    out = accept_sampled(
        [tree] * 500, p.repeat(500, 1), [2 * i for i in range(500)], generator=torch.Generator().manual_seed(0)
    )
    assert all(nodes == [] and toks[0] in (1, 2) for toks, nodes in out)


# ---------------------------------------------------------------- grammars
@pytest.fixture(scope="module")
def xgrammar_backend(default_tokenizer):
    from plait.runtime.constrained import create_grammar_backend

    return create_grammar_backend("xgrammar", default_tokenizer)


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)


def test_grammar_drafts_are_the_forced_tokens_and_leave_the_matcher_as_it_was(xgrammar_backend, default_tokenizer):
    tok = default_tokenizer
    matcher = xgrammar_backend.compile_sync(("json", SCHEMA)).new_matcher()
    drafts = GrammarDrafts(tok, tok.all_special_ids)
    proposed, forced = drafts.propose(matcher, [], 16)
    assert tok.decode(proposed) == '{"name":"' and forced == [True] * len(proposed)
    # the matcher was rolled back: the same proposal again, and it still accepts the first token
    assert drafts.propose(matcher, [], 16)[0] == proposed
    for t in proposed:
        assert matcher.accept_token(t)
    value = tok.encode("Ada", add_special_tokens=False) + tok.encode('"', add_special_tokens=False)
    for t in value:
        assert matcher.accept_token(t)
    assert tok.decode(drafts.propose(matcher, [], 16)[0]) == ',"age":'
    # where nothing is forced, the lookup extends the chain while the grammar allows it
    nums = tok.encode("42}", add_special_tokens=False)
    for t in tok.encode(',"age":', add_special_tokens=False):
        matcher.accept_token(t)
    assert drafts.propose(matcher, [], 8, extend=lambda ctx, k, extra, longer: nums + [0, 0][:k]) == (
        nums,
        [False] * len(nums),
    )
    # a lookup the grammar cuts short goes on with the text forced after what it kept
    fresh = xgrammar_backend.compile_sync(("json", SCHEMA)).new_matcher()
    for t in tok.encode('{"name":"Ada', add_special_tokens=False):
        assert fresh.accept_token(t)
    quote, junk = tok.encode('"', add_special_tokens=False), tok.encode(" x", add_special_tokens=False)
    asked = []

    def lookup(ctx, k, extra, longer):
        asked.append(longer)
        return quote + junk

    got, forced = drafts.propose(fresh, [], 16, extend=lookup)
    assert tok.decode(got) == '","age":' and forced == [False] + [True] * (len(got) - 1)
    # (asked again after the forced text: a match must be longer than the forced drafts ending the chain)
    assert asked == [0, len(got) - 1]


def test_grammar_masks_down_a_tree_follow_each_path(xgrammar_backend, default_tokenizer):
    from plait.runtime.constrained.bitmask import allocate_token_bitmask, unpack_bitmask

    tok = default_tokenizer
    compiled = xgrammar_backend.compile_sync(("regex", "(yes|no), (maybe|never)"))
    matcher = compiled.new_matcher()
    yes, no = tok.encode("yes", add_special_tokens=False), tok.encode("no", add_special_tokens=False)
    assert len(yes) == len(no) == 1
    comma = tok.encode(",", add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)
    tree = DraftTree([0, yes[0], no[0], comma[0], bad[0]], [-1, 0, 0, 1, 2])
    vocab = xgrammar_backend.vocab_size
    bitmask = allocate_token_bitmask(6, vocab)
    reachable = fill_tree_bitmask(matcher, tree, bitmask, 1)
    assert reachable == [True, True, True, True, False]  # "no" then "x" leaves the grammar
    allowed = unpack_bitmask(bitmask, vocab)
    assert allowed[1, yes[0]] and allowed[1, no[0]] and not allowed[1, comma[0]]  # the root
    assert allowed[2, comma[0]] and not allowed[2, yes[0]]  # after "yes"
    assert allowed[5].all()  # the unreachable node: left open (never accepted: its parent's mask bans it)
    # the matcher is where it started
    fresh = compiled.new_matcher()
    check, ref = allocate_token_bitmask(1, vocab), allocate_token_bitmask(1, vocab)
    matcher.fill_bitmask(check, 0)
    fresh.fill_bitmask(ref, 0)
    assert torch.equal(check, ref)


# ---------------------------------------------------------------- verify steps
def test_a_verify_step_puts_nodes_after_the_prefix_at_their_depth():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 0, 2])
    lone = DraftTree([9], [-1])
    step = build_verify_step([3, 1], [10, 4], [tree, lone], np.array([11, 12, 13, 14, 15]))
    assert step.mode.is_verify() and step.extend_lens == [4, 1] and step.prefix_lens == [10, 4]
    assert step.token_rows[1].tolist() == [10, 11, 11, 12, 4]  # sequence positions: prefix + depth
    assert step.token_rows[4].tolist() == [10, 11, 12, 13, 4]  # req_to_token positions: prefix + index
    assert step.kv_writes[1].tolist() == [10, 11, 12, 13, 4] and step.kv_writes[2].tolist() == [11, 12, 13, 14, 15]
    assert step.seq_lens == [14, 5]
    assert step.draft.tree_mask.tolist()[:16] == tree.ancestor_mask().reshape(-1).tolist()
    assert [t.tokens for t in step_trees(step)] == [[5, 6, 7, 8], [9]]


# ---------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(speculative_algorithm="MEDUSA"), "speculative_algorithm must be one of"),
        (dict(speculative_algorithm="EAGLE"), "needs speculative_draft_model_path"),
        (dict(speculative_algorithm="STANDALONE"), "needs speculative_draft_model_path"),
        (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0), "speculative_num_draft_tokens must be"),
        (
            dict(speculative_algorithm="NGRAM", speculative_num_steps=2, speculative_num_draft_tokens=5),
            "cannot be verified",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2), "needs a draft model"),
        (dict(speculative_draft_model_path="/x"), "uses no draft model"),
        (dict(speculative_grammar_drafts="always"), "speculative_grammar_drafts must be one of"),
        (dict(speculative_algorithm="NGRAM", attention_backend="flashinfer"), "flashinfer has no verify mode"),
        (
            dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/x", tp_size=2, pp_size=2),
            "through pipeline stages",
        ),
        (dict(speculative_algorithm="NGRAM", pp_size=2), "through pipeline stages"),
        (dict(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=3), "is above"),
        (
            dict(
                speculative_algorithm="EAGLE",
                speculative_draft_model_path="/x",
                speculative_num_steps=2,
                speculative_eagle_topk=2,
                speculative_num_draft_tokens=9,
            ),
            "is more than a tree",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kw)


def test_speculative_defaults():
    assert ServerArgs(speculative_algorithm="ngram").speculative_shape() == (12, 1, 13)
    eagle = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x")
    assert eagle.speculative_algorithm == "EAGLE" and eagle.speculative_shape() == (3, 1, 4)
    tree = ServerArgs(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_num_steps=3,
        speculative_eagle_topk=2,
    )
    assert tree.speculative_shape() == (3, 2, 8)


def test_the_cost_model_weighs_drafts_against_the_verify_steps_premium():
    from plait.runtime.speculative.cost import StepCosts, allocate

    costs = StepCosts()

    def each(p: float) -> list[list[float]]:  # 8 requests whose 4 drafts are each accepted with chance p
        return [[p**j for j in range(1, 5)]] * 8

    assert allocate(costs, [4] * 8, each(0.1)) == [4] * 8  # nothing timed yet: everything asked
    for _ in range(2):
        costs.decode.record(8, 5e-3)
        costs.verify.record(16, 7.5e-3)
        costs.verify.record(40, 8.0e-3)
    # A verify step of 9 tokens costs what the smallest timed one does (1.5x the decode step), not 1/8 more:
    # drafts accepted 1 time in 10 never pay it, drafts accepted 9 in 10 all do.
    assert allocate(costs, [4] * 8, each(0.1)) == [0] * 8
    assert allocate(costs, [4] * 8, each(0.9)) == [4] * 8
    # Timed between decisions: the step decided for other requests, or interrupted, is not measured.
    costs.decided(("a",), False, 1, now=0.0)
    costs.begin(("a", "b"), now=1.0)
    costs.decided(("a",), True, 3, now=2.0)
    costs.interrupt()
    costs.begin(("a",), now=3.0)
    assert not costs.decode.measured(1) and not costs.verify.measured(3)
    for t in (4.0, 4.002, 4.004):
        costs.begin(("a",), now=t)
        costs.decided(("a",), False, 1, now=t)
    assert costs.decode.estimate(1) == pytest.approx(2e-3)


def _drive(guard, rids, rates, steps, shares=None):
    """`steps` steps of the batch `rids`, each 10 ms with a decision before it (as on a CPU); a step run
    under an arm gains rates[arm] / 100 tokens, shared among the requests equally or as shares[arm] says.
    Returns the arm of each step."""
    now, tokens, arms = 0.0, [0.0] * len(rids), []
    for _ in range(steps):
        arm = guard.checkpoint(rids, tokens, now)
        guard.step()
        arms.append(arm)
        now += 0.01
        share = (shares or {}).get(arm) or [1 / len(rids)] * len(rids)
        tokens = [t + rates[arm] * 0.01 * f for t, f in zip(tokens, share)]
    return arms


def test_the_guard_runs_the_policy_that_delivers_most_and_probes_the_others():
    from plait.runtime.speculative.guard import Arm, SpeculationGuard

    # Speculating pays (WEIGHED 1500 tok/s against OFF 1000): ALL is tried too, and wins at 2000; the others
    # are still probed now and then.
    g = SpeculationGuard()
    arms = _drive(g, ("a", "b"), {Arm.WEIGHED: 1500, Arm.OFF: 1000, Arm.ALL: 2000}, 2000)
    r = g.report()[2]
    assert r == {"weighed": 1500.0, "off": 1000.0, "all": 2000.0, "best": "all"}, r
    assert arms[-1000:].count(Arm.ALL) > 0.8 * 1000 and len(set(arms[-1000:])) == 3
    # Drafts do not pay: the batch stops speculating, its OFF stretches growing so that the probes cost
    # little; ALL is not tried (verifying what the cost model chose was clearly slower than OFF).
    g = SpeculationGuard()
    arms = _drive(g, ("a", "b"), {Arm.WEIGHED: 900, Arm.OFF: 1000, Arm.ALL: 800}, 2000)
    r = g.report()[2]
    assert r == {"weighed": 900.0, "off": 1000.0, "best": "off"}, r
    assert arms[-1000:].count(Arm.OFF) > 0.9 * 1000 and Arm.WEIGHED in arms[-1000:] and Arm.ALL not in arms
    # No draft is ever accepted (each 10 ms step gives each request one token): ALL is not tried.
    g = SpeculationGuard()
    arms = _drive(g, ("a", "b"), {Arm.WEIGHED: 196, Arm.OFF: 200, Arm.ALL: 150}, 2000)
    assert Arm.ALL not in arms and "all" not in g.report()[2]
    # The cost model too careful (as slow as OFF) where verifying everything pays: ALL is tried.
    g = SpeculationGuard()
    arms = _drive(g, ("a",), {Arm.WEIGHED: 1000, Arm.OFF: 1000, Arm.ALL: 1350}, 2000)
    assert g.report()[1]["best"] == "all" and arms[-1000:].count(Arm.ALL) > 0.8 * 1000


def test_the_guard_weighs_a_batch_by_its_requests_own_rates():
    from plait.runtime.speculative.guard import Arm, SpeculationGuard

    # Verifying makes every step slower, but one request of four copies its prompt: the batch's tokens per
    # second go up (1340 against OFF's 1000), its other three requests' go down (180 each against 250).
    # The harmonic mean counts each request's own rate: 4 / (1/800 + 3/180) = 223 per request, 893 for
    # the batch, not the sum's 1340: the batch runs OFF.
    g = SpeculationGuard()
    share = [800 / 1340] + [180 / 1340] * 3
    arms = _drive(
        g,
        ("a", "b", "c", "d"),
        {Arm.WEIGHED: 1340, Arm.OFF: 1000, Arm.ALL: 1340},
        3000,
        {Arm.ALL: share, Arm.WEIGHED: share},
    )
    r = g.report()[4]
    assert r["best"] == "off" and r["weighed"] == pytest.approx(4 * 4 / (1 / 800 + 3 / 180), rel=1e-3), r
    assert arms[-1000:].count(Arm.OFF) > 0.9 * 1000


def test_a_guard_stretch_cut_short_counts_up_to_its_last_decision():
    from plait.runtime.speculative.guard import Arm, SpeculationGuard

    g = SpeculationGuard()
    assert g.checkpoint(("a",), (0,), 0.0) is Arm.WEIGHED
    for k in range(1, 6):
        g.step()
        g.checkpoint(("a",), (10 * k,), 0.1 * k)
    g.step()  # the request's last step: it finishes, and the next decision is another batch's
    assert g.checkpoint(("b",), (0,), 1.0) is Arm.OFF  # (the next arm to measure)
    assert g.report() == {1: {"weighed": 100.0, "best": None}}  # 50 tokens in 0.5 s, to its last decision
    g.step()
    g.interrupt()  # a prefill right after the stretch's first decision: nothing to count
    assert g.stretches[Arm.WEIGHED] == 1
    assert g.checkpoint(("b",), (0,), 2.0) is Arm.OFF
    for k in (1, 2):
        g.step()
        g.checkpoint(("b",), (30 * k,), 2.0 + 0.1 * k)
    g.step()
    g.interrupt()  # a prefill mid-stretch
    # (OFF looks better: both are measured again before it is run)
    assert g.report() == {1: {"weighed": 100.0, "off": 300.0, "best": None}}


def test_an_eagle_head_beside_a_split_target_needs_the_targets_embedding(tmp_path):
    # Rank 0's whole copy of the embedding and LM head is read from the target's checkpoint: one without an
    # embedding is refused, naming what is missing; a tied one serves as both.
    from plait.runtime.executor.spec_runner import WholeVocabulary
    from plait.runtime.models.config import ModelConfig
    from safetensors.torch import save_file

    cfg = ModelConfig.from_dict(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=16,
            hidden_size=4,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )
    save_file({"lm_head.weight": torch.ones(16, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="has no model.embed_tokens.weight"):
        WholeVocabulary.read(str(tmp_path), cfg, "auto", torch.float32, "cpu")
    emb = torch.randn(16, 4)
    save_file({"model.embed_tokens.weight": emb}, str(tmp_path / "model.safetensors"))
    whole = WholeVocabulary.read(str(tmp_path), cfg, "auto", torch.float32, "cpu")
    hidden = torch.randn(3, 4)
    torch.testing.assert_close(whole.compute_logits(hidden), hidden @ emb.t())
    torch.testing.assert_close(whole.embed_tokens(torch.tensor([2, 5])), emb[[2, 5]])
