"""Grammar-forced drafts, and grammar masks down a draft tree.

A constrained request's grammar often fixes what comes next (a JSON key, `":`, a closing bracket).
Proposed as drafts, those tokens are verified by the target like any others, so the output is exactly
plain constrained decoding's (where jump-forward retokenizes the boundary between the model's text and
the forced text, which can change the output), while the steps they save are jump-forward's. Where
nothing is forced (a free value), another proposer (prompt lookup) may continue the chain; its tokens
are kept only while the grammar allows them.

A forced text is proposed as the tokens the target wrote it with before, when it did (`learn`: a model
tokenizes JSON punctuation its own way, `":` then `"` where the tokenizer's encoding of `":"` is one
token, and a draft the target tokenizes otherwise is rejected), else as the tokenizer encodes it.

Everything here walks the request's own matcher forward and rolls it back before returning
(`GrammarMatcher.rollback`): the matcher always ends in the state it started in.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .tree import DraftTree

# Forced strings repeat across the requests of one schema: their encodings are kept (bounded dicts).
ENCODE_CACHE_SIZE = 4096

# (committed tokens, at most, drafts so far, longer_than): a lookup whose match is a suffix of more than
# longer_than tokens (NgramIndex.propose)
Extend = Callable[[Sequence[int], int, list[int], int], list[int]]


class GrammarDrafts:
    def __init__(self, tokenizer: Any, special_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.special = frozenset(special_ids)
        self._encoded: dict[str, tuple[int, ...]] = {}
        self._learned: dict[str, tuple[int, ...]] = {}  # forced text -> the tokens the target wrote it as

    def propose(
        self,
        matcher: Any,
        context: Sequence[int],
        max_drafts: int,
        extend: Optional[Extend] = None,
        max_guessed: Optional[int] = None,
    ) -> tuple[list[int], list[bool]]:
        """A chain of at most `max_drafts` draft tokens after `context` (the request's tokens) that the
        grammar allows: the forced text's tokens, then `extend`'s proposals (at most `max_guessed` of
        them) where nothing is forced; and which of them the grammar forced."""
        drafts: list[int] = []
        forced: list[bool] = []
        if max_drafts <= 0 or matcher.is_terminated():
            return drafts, forced
        limit = min(max_drafts, matcher.max_rollback)
        with matcher.drafting():
            self._walk(
                matcher, context, limit, extend, max_drafts if max_guessed is None else max_guessed, drafts, forced
            )
        return drafts, forced

    def _walk(
        self,
        matcher: Any,
        context: Sequence[int],
        limit: int,
        extend: Optional[Extend],
        guesses: int,
        drafts: list[int],
        kinds: list[bool],
    ) -> None:
        # NOTE: forced text repeats wherever the schema does (each key is followed by `": "`): a lookup match
        # on forced drafts alone says nothing about what the model writes next, so it must reach back past
        # the forced drafts that end the chain into tokens the model chose (or the prompt's).
        forced_tail = 0
        try:
            while len(drafts) < limit and not matcher.is_terminated():
                forced = matcher.jump_forward_string()
                room = limit - len(drafts)
                if forced:
                    cand = list(self._encode(forced)[:room])
                elif extend is not None and guesses > 0:
                    cand = extend(context, min(room, guesses), drafts, forced_tail)
                else:
                    cand = []
                took = 0
                for tok in cand:
                    if tok in self.special or not matcher.accept_token(tok):
                        break
                    drafts.append(tok)
                    kinds.append(bool(forced))
                    took += 1
                    if matcher.is_terminated():
                        break
                if took == 0:
                    break  # nothing more to propose
                forced_tail = forced_tail + took if forced else 0
                guesses -= 0 if forced else took
                # (a lookup the grammar cut short goes on with the text the grammar forces there, if any:
                # the next round looks again, and stops if nothing is forced and the lookup gives nothing new)
        finally:
            matcher.rollback(len(drafts))

    def learn(self, forced: str, written: Sequence[int]) -> Optional[bool]:
        """The target wrote `written` (its tokens since `forced` was what the grammar forced): remember
        the tokens that spell `forced` exactly. True: learned; False: they do not spell it (the target
        went on past it inside one token); None: not yet known (they spell only part of it so far)."""
        text = self.tokenizer.decode(list(written))
        if not text.startswith(forced):
            return None if forced.startswith(text) else False
        for j in range(1, len(written) + 1):
            if self.tokenizer.decode(list(written[:j])) == forced:
                if len(self._learned) >= ENCODE_CACHE_SIZE:
                    self._learned.clear()
                self._learned[forced] = tuple(written[:j])
                return True
        return False

    def _encode(self, text: str) -> tuple[int, ...]:
        learned = self._learned.get(text)
        if learned is not None:
            return learned
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= ENCODE_CACHE_SIZE:
                self._encoded.clear()
            ids = self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return ids


def fill_tree_bitmask(matcher: Any, tree: DraftTree, bitmask: torch.Tensor, first_row: int) -> list[bool]:
    """Row first_row + i of `bitmask` (int32 (R, W) on the host) gets what the grammar allows after node
    i's path (the drafts from the root down to it), for every node the grammar allows; returns which
    nodes it allows (a node below a draft the grammar rejects is unreachable: its row is left
    all-allowed, and a masked target can never accept it). The matcher ends where it started."""
    reachable = [False] * tree.size
    kids = tree.children()

    def fill(node: int, row: int) -> None:
        if matcher.is_terminated():
            bitmask[row].fill_(-1)  # a stop token was accepted: nothing follows it (keeps the row finite)
        else:
            matcher.fill_bitmask(bitmask, row)

    # The root's row at the output's own state (the matcher's decisions are taken there); the drafts' rows
    # inside `drafting` (states the output may never reach).
    fill(0, first_row)
    reachable[0] = True
    with matcher.drafting():
        _fill_below_root(matcher, tree, bitmask, first_row, reachable, kids, fill)
    return reachable


def _fill_below_root(
    matcher: Any,
    tree: DraftTree,
    bitmask: torch.Tensor,
    first_row: int,
    reachable: list[bool],
    kids: list[list[int]],
    fill: Callable[[int, int], None],
) -> None:
    """The rows of every node below the root (the root's row is filled); the matcher ends at the root."""
    n = tree.size
    depth_budget = matcher.max_rollback

    def visit(node: int, depth: int) -> None:  # node's row is filled: its children's next
        for c in kids[node]:
            if depth >= depth_budget or matcher.is_terminated() or not matcher.accept_token(tree.tokens[c]):
                _all_allowed(bitmask, first_row, tree, c, kids)
                continue
            reachable[c] = True
            fill(c, first_row + c)
            visit(c, depth + 1)
            matcher.rollback(1)

    if tree.is_chain():  # no recursion for the common case
        accepted = 0
        for i in range(1, n):
            if i > depth_budget or matcher.is_terminated() or not matcher.accept_token(tree.tokens[i]):
                for j in range(i, n):
                    bitmask[first_row + j].fill_(-1)
                break
            accepted += 1
            reachable[i] = True
            fill(i, first_row + i)
        matcher.rollback(accepted)
        return
    visit(0, 0)


def _all_allowed(bitmask: torch.Tensor, first_row: int, tree: DraftTree, node: int, kids: list[list[int]]) -> None:
    stack = [node]
    while stack:
        x = stack.pop()
        bitmask[first_row + x].fill_(-1)
        stack.extend(kids[x])
