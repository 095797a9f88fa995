"""What the server's speculative settings mean for the scheduler: which proposers run, how many drafts a
request may have, up to which batch size guessed drafts are proposed, whether the cost model adapts."""

from __future__ import annotations

from dataclasses import dataclass

from ..server_args import ServerArgs
from ..setting_values import MODEL_DRAFT_ALGORITHMS


@dataclass(frozen=True)
class SpecSettings:
    ngram: bool  # prompt lookup (NGRAM)
    model_drafts: bool  # the runner drafts (STANDALONE, EAGLE, EAGLE3)
    grammar: bool  # grammar-forced drafts for constrained requests
    max_drafts: int  # draft tokens per request and step (num_draft_tokens - 1)
    tree_nodes: int  # nodes of a model-drafted tree (num_draft_tokens)
    chain_only: bool  # model drafts are chains (topk 1): their length adapts too
    # req_to_token positions a drafter writes past a request's sequence while it drafts a tree (its
    # scratch: the root and each later step's frontier).
    draft_span: int
    max_batch: int  # no speculation with more running requests
    adaptive: bool

    @classmethod
    def of(cls, sa: ServerArgs) -> "SpecSettings":
        steps, topk, tokens = sa.speculative_shape()
        grammar = sa.grammar_drafts_enabled()  # (an explicit "on" where drafts cannot run is refused at start-up)
        return cls(
            ngram=sa.speculative_algorithm == "NGRAM",
            model_drafts=sa.speculative_algorithm in MODEL_DRAFT_ALGORITHMS,
            grammar=grammar,
            max_drafts=tokens - 1,
            tree_nodes=tokens,
            chain_only=topk == 1,
            draft_span=max(tokens, 1 + topk * (steps - 1)),
            max_batch=sa.resolved_speculative_disable_by_batch_size(),
            adaptive=not sa.disable_speculative_adaptive,
        )

    @property
    def enabled(self) -> bool:
        return self.ngram or self.model_drafts or self.grammar
