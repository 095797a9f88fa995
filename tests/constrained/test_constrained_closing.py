"""The budget closing (issue 22), driven through the GrammarManager with scripted logits: a rambling model
closed exactly at its budget, a loop closed long before it, closing off, impossible budgets, regex outputs,
one search shared by a batch of one constraint, and the closing under grammar drafts. On the real SmolLM2
tokenizer and the real grammar backends."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from helpers.constrained import PERSON, VOCAB
from plait.runtime import ServerArgs
from plait.runtime.constrained.bitmask import allocate_token_bitmask
from plait.runtime.constrained.integration import GrammarManager
from plait.runtime.detokenizer import IncrementalDetokenizer
from plait.runtime.sampling_params import SamplingParams


# ---------------------------------------------------------------- the closing, through the GrammarManager
def fake_request(manager, tokenizer, max_new_tokens: int, **params):
    sp = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, **params})
    req = SimpleNamespace(
        sampling_params=sp,
        output_ids=[],
        finished_reason=None,
        max_new_tokens=max_new_tokens,
        detok=IncrementalDetokenizer(tokenizer),
        return_logprob=False,
    )
    req.remaining_new_tokens = lambda: max(0, req.max_new_tokens - len(req.output_ids))
    req.grammar = manager.request(sp).result()
    return req


def drive(manager, req, preferred: list[int], tokenizer, steps: int = 400) -> str:
    """Decode with scripted logits: the preferred tokens score highest, in order (where the grammar forces
    text, the first token of its encoding); jump-forward on."""
    scores = torch.zeros(VOCAB)
    for rank, token in enumerate(preferred):
        scores[token] = 100.0 - rank
    for _ in range(steps):
        if req.finished_reason is not None or req.grammar.is_terminated() or req.remaining_new_tokens() == 0:
            break
        logits = scores.clone().unsqueeze(0)  # (1, V)
        forced = req.grammar.inner.jump_forward_string()
        if forced:  # text the grammar fixes: written with the tokenizer's tokens, as a model would
            logits[0, tokenizer.encode(forced, add_special_tokens=False)[0]] = 200.0
        manager.fill_and_apply(logits, [req])
        token = int(torch.argmax(logits[0]))
        req.output_ids.append(token)
        assert manager.accept(req, token)
        if req.finished_reason is None and not req.grammar.is_terminated():
            manager.jump_forward(req)
    return tokenizer.decode(req.output_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    args = ServerArgs(grammar_backend="xgrammar", grammar_compile_timeout=60.0)
    made = GrammarManager(default_tokenizer, VOCAB, args)
    yield made
    made.backend.shutdown()


def test_a_model_that_rambles_is_closed_exactly_at_the_budget(manager, default_tokenizer):
    """The scripted model writes "ab" inside the name forever; the output still ends as a valid object, with
    its last token the budget's last one, and says why."""
    ab = default_tokenizer.encode("ab", add_special_tokens=False)[0]
    schema = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string"}}}
    for budget, temperature in ((40, 0), (50, 0), (57, 0), (50, 1.0)):  # (past 32 "ab"s the loop watch acts first)
        # (temperature 1: the sampled path keeps every fitting token of the likeliest few; argmax picks here)
        req = fake_request(manager, default_tokenizer, budget, json_schema=json.dumps(schema), temperature=temperature)
        text = drive(manager, req, [ab], default_tokenizer)
        assert json.loads(text)["name"].startswith("abab")
        jsonschema.validate(json.loads(text), schema)
        assert req.finished_reason.type == "length" and len(req.output_ids) == budget
        assert req.grammar.closed_early == "budget"


def test_a_loop_is_closed_long_before_the_budget(manager, default_tokenizer):
    digits = [default_tokenizer.encode(d, add_special_tokens=False)[0] for d in "1234567890"]
    schema = {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}
    req = fake_request(manager, default_tokenizer, 384, json_schema=json.dumps(schema))
    scores = torch.zeros(VOCAB)
    text_ids = []
    for _ in range(384):  # the model's favourite next digit is always the one after the last
        if req.grammar.is_terminated() or req.finished_reason is not None:
            break
        last = default_tokenizer.decode(req.output_ids[-1:]) if req.output_ids else ""
        nxt = digits[(int(last) % 10)] if last.isdigit() else digits[0]
        scores.zero_()
        scores[nxt] = 50
        logits = scores.clone().unsqueeze(0)
        manager.fill_and_apply(logits, [req])
        token = int(torch.argmax(logits[0]))
        req.output_ids.append(token)
        text_ids.append(token)
        assert manager.accept(req, token)
        if not req.grammar.is_terminated():
            manager.jump_forward(req)
    text = default_tokenizer.decode(req.output_ids, skip_special_tokens=True)
    assert json.loads(text)["id"].startswith("1234567890")
    assert req.grammar.closed_early == "repetition" and req.grammar.is_terminated()
    assert len(req.output_ids) < 80


def test_closing_off_leaves_the_model_alone(manager, default_tokenizer):
    ab = default_tokenizer.encode("ab", add_special_tokens=False)[0]
    req = fake_request(manager, default_tokenizer, 40, json_schema=json.dumps(PERSON), close_within_budget=False)
    text = drive(manager, req, [ab], default_tokenizer)
    assert text.startswith('{"name": "abab') and req.grammar.closed_early is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_an_impossible_budget_is_left_to_the_model(manager, default_tokenizer):
    """No valid object fits in 4 tokens: nothing is forced (and the counter says so)."""
    before = manager.counters["grammar_close_overshoots"]
    req = fake_request(manager, default_tokenizer, 4, json_schema=json.dumps(PERSON))
    drive(manager, req, [default_tokenizer.encode("ab", add_special_tokens=False)[0]], default_tokenizer)
    assert req.grammar.closed_early is None and manager.counters["grammar_close_overshoots"] == before + 1


def test_regex_output_is_closed_within_the_budget(manager, default_tokenizer):
    pattern = r"(yes|no), because [a-z ]{1,60}\."
    a = default_tokenizer.encode(" a", add_special_tokens=False)[0]
    yes = default_tokenizer.encode("yes", add_special_tokens=False)[0]
    req = fake_request(manager, default_tokenizer, 16, regex=pattern)
    text = drive(manager, req, [yes, a], default_tokenizer)
    assert re.fullmatch(pattern, text), text
    assert req.finished_reason.type == "length" and req.grammar.closed_early == "budget"


def test_requests_of_one_constraint_search_once_and_write_what_each_writes_alone(manager, default_tokenizer):
    """A batch of date answers under one regex: the first request's search from the opening state is kept
    (CompletionSearch's memo) and the others take its text instead of searching again; after the model's own
    digits the old completion less as many bytes still completes (the fixed-width hint), so no request searches
    again. Each output is what the same request writes alone on a fresh manager."""
    pattern = r"(1[0-9]|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    digits = [default_tokenizer.encode(d, add_special_tokens=False)[0] for d in "4719"]
    stats = manager.search.stats
    before = dict(stats)
    texts = []
    for i in range(4):
        req = fake_request(manager, default_tokenizer, 16, regex=pattern)
        texts.append(drive(manager, req, digits[i:] + digits[:i], default_tokenizer))
        assert re.fullmatch(pattern, texts[-1]), texts[-1]
    assert stats["completion_searches"] - before["completion_searches"] == 1
    assert stats["completion_memo"] - before["completion_memo"] == 3
    alone = GrammarManager(
        default_tokenizer, VOCAB, ServerArgs(grammar_backend="xgrammar", grammar_compile_timeout=60.0)
    )
    try:
        req = fake_request(alone, default_tokenizer, 16, regex=pattern)
        assert drive(alone, req, digits[3:] + digits[:3], default_tokenizer) == texts[3]
        assert alone.search.stats["completion_searches"] == 1 and alone.search.stats["completion_memo"] == 0
    finally:
        alone.backend.shutdown()


# ---------------------------------------------------------------- the closing under grammar drafts
def scripted_logits(grammar, scores: torch.Tensor, tokenizer) -> torch.Tensor:
    """(V,) the scripted model of `drive` at the grammar's state: `scores`, and where text is forced its
    tokenizer encoding's first token above everything."""
    logits = scores.clone()
    forced = grammar.inner.jump_forward_string()
    if forced:
        logits[tokenizer.encode(forced, add_special_tokens=False)[0]] = 200.0
    return logits


def finished(req) -> bool:
    return req.finished_reason is not None or req.grammar.is_terminated() or req.remaining_new_tokens() == 0


def plain_greedy(manager, req, scores: torch.Tensor, tokenizer) -> list[int]:
    """Plain constrained decoding of the scripted model (no jump-forward, no drafts)."""
    while not finished(req):
        logits = scripted_logits(req.grammar, scores, tokenizer).unsqueeze(0)  # (1, V)
        manager.fill_and_apply(logits, [req])
        token = int(torch.argmax(logits[0]))
        req.output_ids.append(token)
        assert manager.accept(req, token)
    return req.output_ids


def drafted_greedy(manager, req, scores: torch.Tensor, tokenizer, guess: int, max_drafts: int = 8):
    """The same model in verify steps as the scheduler runs grammar drafts (speculation.py, verify.py,
    results.py): the forced text and then `guess` (the model's favourite, a perfect lookup) as drafts within
    draft_room, every node scored under its plain mask (the root's refined), the longest match taken and
    committed through keeps_verified. Returns the output, the steps with drafts while the closer chose, and
    the commits keeps_verified cut short."""
    from plait.runtime.constrained.bitmask import apply_token_bitmask_inplace
    from plait.runtime.speculative.acceptance import accept_greedy
    from plait.runtime.speculative.grammar_drafts import GrammarDrafts, fill_tree_bitmask
    from plait.runtime.speculative.tree import DraftTree

    drafter = GrammarDrafts(tokenizer, tokenizer.all_special_ids)
    choosing_steps = cuts = 0
    plain_greedy_step(manager, req, scores, tokenizer)  # the prefill's token
    while not finished(req):
        g = req.grammar
        n = g.draft_room(min(max_drafts, req.remaining_new_tokens() - 1), free=False)
        drafts, _ = drafter.propose(g, req.output_ids, n, extend=lambda ctx, k, extra, longer: [guess] * k)
        choosing_steps += bool(drafts) and g.closer.choosing
        tree = DraftTree.chain(req.output_ids[-1], drafts)
        bitmask = allocate_token_bitmask(tree.size, VOCAB)
        fill_tree_bitmask(g, tree, bitmask, 0)
        logits = torch.stack(
            [scripted_logits(g, scores, tokenizer)]
            + [_scripted_after(g, drafts[:i], scores, tokenizer) for i in range(1, tree.size)]
        )  # (T, V)
        g.refine_bitmask(logits[0], bitmask[0])
        apply_token_bitmask_inplace(logits, bitmask, list(range(tree.size)))
        tokens, _ = accept_greedy(tree, torch.argmax(logits, dim=1).tolist())
        for j, token in enumerate(tokens):
            if j and not g.keeps_verified(token):
                cuts += 1
                break
            req.output_ids.append(token)
            assert manager.accept(req, token)
            if finished(req):
                break
    return req.output_ids, choosing_steps, cuts


def plain_greedy_step(manager, req, scores: torch.Tensor, tokenizer) -> None:
    logits = scripted_logits(req.grammar, scores, tokenizer).unsqueeze(0)
    manager.fill_and_apply(logits, [req])
    token = int(torch.argmax(logits[0]))
    req.output_ids.append(token)
    assert manager.accept(req, token)


def _scripted_after(grammar, drafts: list[int], scores: torch.Tensor, tokenizer) -> torch.Tensor:
    """The scripted model's logits at the state after `drafts` (the matcher walked there and back)."""
    with grammar.drafting():
        for token in drafts:
            assert grammar.accept_token(token)
        logits = scripted_logits(grammar, scores, tokenizer)
        grammar.rollback(len(drafts))
    return logits


def test_greedy_grammar_drafts_near_the_budget_write_plain_decodings_output(manager, default_tokenizer):
    """A greedy request drafts while the closer chooses (its forced text and the model's own string content):
    each verified token is kept only where plain decoding's decision at it writes it (keeps_verified), so
    the output is plain constrained decoding's to the token, closing included, for budgets that close it
    inside the name, at the forced text between fields, and at the values after it."""
    ab = default_tokenizer.encode("ab", add_special_tokens=False)[0]
    schema = json.dumps({**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string"}}})
    scores = torch.zeros(VOCAB)
    scores[ab] = 100.0
    choosing = cuts = 0
    for budget in (40, 50):
        want = plain_greedy(
            manager,
            fake_request(manager, default_tokenizer, budget, json_schema=schema, temperature=0),
            scores,
            default_tokenizer,
        )
        req = fake_request(manager, default_tokenizer, budget, json_schema=schema, temperature=0)
        got, chose, cut = drafted_greedy(manager, req, scores, default_tokenizer, guess=ab)
        assert got == want, budget
        assert req.grammar.closed_early == "budget"
        choosing, cuts = choosing + chose, cuts + cut
    assert choosing > 0  # drafts were verified where the closer chose (not held back to decoding)
    assert cuts > 0  # and some verified tokens were not plain decoding's there: cut
