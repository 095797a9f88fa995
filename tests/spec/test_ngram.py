"""NGRAM prompt lookup (runtime/speculative/ngram.py) on its own: the longest suffix seen before and what followed
it, drafts on top of drafts, an index that starts over when tokens are rewritten, and lookups that equal a scan
however the tokens arrived."""

from __future__ import annotations

from plait.runtime.speculative.ngram import NgramIndex


def test_ngram_proposes_what_followed_the_longest_suffix_seen_before():
    ix = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert ix.propose(tokens, 3) == [4, 5, 9]  # [1, 2, 3] was followed by 4, 5, 9
    tokens.append(7)
    assert ix.propose(tokens, 3) == []  # [3, 7] and [2, 3, 7]: never seen
    tokens += [1, 2]
    assert ix.propose(tokens, 2) == [3, 7]  # the latest occurrence of [1, 2] wins
    assert ix.propose([8, 8, 8, 8], 5) == [8]  # the continuation stops at the end of what exists
    assert ix.propose(tokens, 3, longer_than=2) == [] and ix.propose(tokens, 2, longer_than=1) == [3, 7]


def test_ngram_looks_up_drafts_on_top_of_drafts_without_indexing_them():
    from plait.runtime.speculative.ngram import TokenView

    ix = NgramIndex(2, 3)
    prompt, out = [1, 2, 3, 4, 5, 6], [9]
    tokens = TokenView(prompt, out)
    assert tokens[2:8] == [3, 4, 5, 6, 9] and tokens[-1] == 9 and len(tokens) == 7
    assert ix.propose(tokens, 3, extra=[3, 4]) == [5, 6, 9]  # the suffix [3, 4] is a draft
    out.append(7)
    assert ix.propose(TokenView(prompt, out), 2) == []  # [9, 7] unseen; the drafts were never indexed


def test_ngram_index_starts_over_when_the_tokens_are_rewritten():
    ix = NgramIndex(2, 3)
    assert ix.propose([1, 2, 3, 1, 2], 2) == [3, 1]
    # the last token dropped and others appended (as after a jump-forward): no stale continuation
    assert ix.propose([1, 2, 3, 1, 5, 6, 1, 5], 2) == [6, 1]


def _lookup_by_brute_force(tokens, max_drafts, extra=(), longer_than=0, min_n=2, max_n=6):
    """What prompt lookup means, by scanning: the longest suffix of tokens + extra (min_n..max_n tokens, more than
    longer_than) seen before in tokens with a token after it; its latest occurrence's continuation."""
    seq = list(tokens) + list(extra)
    for n in range(min(max_n, len(seq) - 1), max(min_n, longer_than + 1) - 1, -1):
        for end in range(len(tokens) - 1, n - 1, -1):
            if list(tokens[end - n : end]) == seq[len(seq) - n :]:
                return seq[end : min(end + max_drafts, len(seq))]
    return []


def test_ngram_lookup_grown_in_any_steps_matches_a_scan():
    # The index holds each 2-gram's positions and extends matches backwards at lookup; however the tokens
    # arrived (a whole prompt, then one token a step, then a few at once), a lookup is what a scan finds.
    import random

    rng = random.Random(5)
    tokens = [rng.randrange(4) for _ in range(300)]  # a small alphabet: many repeated n-grams
    ix = NgramIndex(2, 6)
    grown = 0
    for step in [40, 1, 1, 1, 7, 2, 100, 1, 147]:
        grown += step
        seen = tokens[:grown]
        for max_drafts, extra, longer_than in [(3, (), 0), (5, (), 3), (4, (seen[-3], seen[-1]), 0), (2, (1,), 2)]:
            got = ix.propose(seen, max_drafts, extra, longer_than)
            assert got == _lookup_by_brute_force(seen, max_drafts, extra, longer_than), (grown, max_drafts, extra)
