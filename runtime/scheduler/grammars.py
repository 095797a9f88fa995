"""The scheduler's side of constrained decoding: a request's grammar compiled at intake (asynchronously:
the request waits in GRAMMAR_PENDING until it is ready), each sampled token fed to its matcher after a
step, and the text the grammar forces next planned as a jump-forward tail.

The grammar backend is made on the first constrained request, so an engine that never sees one never
imports xgrammar or outlines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..request import FinishReason, Req
from ..server_args import ServerArgs
from .finish import Finisher
from .queues import RequestQueues

if TYPE_CHECKING:  # (imported when the first constrained request comes: see the module's note)
    from ..constrained.integration import GrammarManager
    from ..constrained.jump_forward import JumpForwardPlan


class SchedulerGrammars:
    def __init__(
        self, tokenizer: Any, vocab_size: int, server_args: ServerArgs, queues: RequestQueues, finisher: Finisher
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.server_args = server_args
        self.queues = queues
        self.finisher = finisher
        self.manager: Optional[GrammarManager] = None  # made on first use

    def start(self, req: Req) -> bool:
        """Start compiling the request's grammar; False when constrained decoding is unavailable (the
        request has ended with the reason)."""
        try:
            if self.manager is None:
                from ..constrained.integration import GrammarManager

                self.manager = GrammarManager(self.tokenizer, self.vocab_size, self.server_args)
            req.grammar_future = self.manager.request(req.sampling_params)
            return True
        except Exception as e:
            self.finisher.end(req, FinishReason("abort", message=f"constrained decoding unavailable: {e}"))
            return False

    def poll(self) -> None:
        """Requests whose grammar compiled go to the waiting queue; a failed compile ends its request."""
        q = self.queues
        if not q.grammar_pending:
            return
        ready, still, failed = [], [], []
        for req in q.grammar_pending:
            fut = req.grammar_future
            if not fut.done():
                still.append(req)
                continue
            req.grammar_future = None
            try:
                req.set_grammar(fut.result())
            except Exception as e:
                req.finished_reason = FinishReason("abort", message=f"invalid grammar: {e}")
                failed.append(req)
                continue
            ready.append(req)
        q.grammars_done(ready, still + failed)
        for req in failed:  # still GRAMMAR_PENDING: ending them takes them off that list
            self.finisher.end(req)

    def accept(self, req: Req, token_id: int) -> bool:
        """Feed a sampled token to the request's matcher; a rejected token aborts the request."""
        assert self.manager is not None, "a constrained request started the grammar manager"
        return self.manager.accept(req, token_id)

    def jump_forward(self, req: Req) -> Optional[JumpForwardPlan]:
        """Append the tokens the grammar forces now to the request's output (a plan), or None."""
        assert self.manager is not None, "a constrained request started the grammar manager"
        return self.manager.jump_forward(req)

    def forced_stop(self, req: Req) -> Optional[int]:
        """The stop token the grammar leaves as the request's only continuation (it ends on it), or None."""
        assert self.manager is not None, "a constrained request started the grammar manager"
        return self.manager.forced_stop(req)

    def stats(self) -> dict:
        return dict(self.manager.stats) if self.manager is not None else {}
