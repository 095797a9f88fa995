"""The sampler's narrow LM head (CPU): rows a grammar narrows to a few tokens are scored on those tokens'
rows of the head alone, and pick what masking the whole logits picks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plait.runtime.constrained.masker import GrammarMasker
from plait.runtime.executor.sampler import NARROW_TOKENS, _narrow_logits, greedy_tokens

VOCAB, HIDDEN = 1000, 32


class _Allows:
    """A matcher that allows a fixed set of tokens next; counts its fills (a fill may decide things)."""

    def __init__(self, ids):
        self.ids, self.fills = list(ids), 0

    def is_terminated(self):
        return False

    def fill_bitmask(self, bitmask, row):
        self.fills += 1
        allowed = torch.zeros(bitmask.shape[1] * 32, dtype=torch.int64)
        allowed[self.ids] = 1
        words = (allowed.view(-1, 32) << torch.arange(32)).sum(dim=1)  # (W,) each word's bits
        bitmask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    wants_logits = False

    def refine_bitmask(self, logits, row):
        pass


class _KeepsAllButLikeliest(_Allows):
    """Reads its row's logits to narrow its bits (as a budget closer choosing does): drops the likeliest."""

    wants_logits = True

    def refine_bitmask(self, logits, row):
        top = int(logits.argmax())
        row[top >> 5] &= ~(1 << (top & 31))


def _head_and_states(rows: int):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)  # (V, hidden)
    states = torch.randn(rows, HIDDEN, generator=g)  # (S, hidden)
    return weight, states, (lambda h, ids: F.linear(h, weight.index_select(0, ids)).float())


def test_narrow_logits_pick_what_masking_the_whole_logits_picks():
    weight, states, logits_at = _head_and_states(3)
    matchers = [_Allows([5, 17, 900]), _Allows(range(40, 60)), _Allows([999])]
    masker = GrammarMasker(VOCAB)
    bitmask = masker.fill(matchers, 3)
    assert [m.fills for m in matchers] == [1, 1, 1]
    narrow = _narrow_logits(states, logits_at, bitmask, VOCAB)
    whole = F.linear(states, weight).float()  # (S, V)
    ids = torch.tensor(sorted([5, 17, 900, *range(40, 60), 999]))
    assert torch.equal(narrow.ids, ids)
    torch.testing.assert_close(narrow.values, whole[:, ids])
    row = narrow.row(1)
    assert torch.equal(row[ids], narrow.values[1]) and bool(row[[0, 6, 998]].isinf().all())
    masker.apply(whole, matchers)  # fills again: the whole-logits path of a step
    assert torch.equal(narrow.greedy(bitmask), greedy_tokens(whole))


def test_narrow_greedy_reads_refined_bits_ties_and_empty_rows():
    """The narrow argmax follows bits a matcher refined by its row's logits (only that row's are made), takes
    the first token on ties, and gives token 0 to a row allowing nothing, as the whole-logits argmax does."""
    weight, states, logits_at = _head_and_states(3)
    matchers = [_KeepsAllButLikeliest([3, 8, 700]), _Allows([8, 9]), _Allows([])]
    masker = GrammarMasker(VOCAB)
    bitmask = masker.fill(matchers, 3)
    narrow = _narrow_logits(states, logits_at, bitmask, VOCAB)
    made = []
    masker.refine(matchers, bitmask, lambda i: made.append(i) or narrow.row(i))
    assert made == [0]
    whole = F.linear(states, weight).float()
    kept = sorted([3, 8, 700], key=lambda t: -float(whole[0, t]))[1:]
    want = [max(kept, key=lambda t: float(whole[0, t])), max([8, 9], key=lambda t: float(whole[1, t])), 0]
    assert narrow.greedy(bitmask).tolist() == want
    narrow.values[1] = 1.0  # a tie: the first allowed token
    assert narrow.greedy(bitmask).tolist()[1] == 8


def test_a_row_allowing_many_tokens_keeps_the_whole_head():
    _, states, logits_at = _head_and_states(2)
    matchers = [_Allows([1, 2]), _Allows(range(NARROW_TOKENS + 1))]
    bitmask = GrammarMasker(VOCAB).fill(matchers, 2)
    assert _narrow_logits(states, logits_at, bitmask, VOCAB) is None
