"""A step runner with no model, for scheduler tests that assert exact state in milliseconds.

It implements the scheduler's `StepRunner` seam (runtime/scheduler/step_runner.py) over CPU memory of the
sizes a test asks for, records every `StepInput` it is handed, and answers each sampling row with a
scripted token: by default `2 + (prompt length + tokens so far) % (vocab - 2)` (deterministic, never the
EOS id 1), or what `script(row)` returns. A row with a grammar gets the first token its matcher allows
among the script's preference (the real grammar masker, over fake logits).

VERIFY steps (speculative decoding) go through the real verifier (executor/verify.py) over fake logits
that prefer, at each node, the script's token for the node's path; a request the runner drafts for gets
the tree `drafter(row, root, size)` returns (default: a chain of the script's own tokens, every draft
accepted).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from plait.runtime.constrained.masker import GrammarMasker
from plait.runtime.executor.runner_info import RunnerInfo
from plait.runtime.executor.verify import Verifier
from plait.runtime.io_struct import FlushCacheReq, TokenizedGenerateReq
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool, TokenAllocator
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs
from plait.runtime.speculative.tree import DraftTree
from plait.runtime.speculative.verify_step import refresh_masks, set_tree, step_trees
from plait.runtime.step import SamplingRow, StepInput, StepOutput

EOS = 1


def default_script(vocab_size: int) -> Callable[[SamplingRow], int]:
    return lambda row: 2 + (len(row.prompt_ids) + len(row.output_ids)) % (vocab_size - 2)


class FakeRunner:
    def __init__(
        self,
        max_total_tokens: int = 256,
        max_running_requests: int = 8,
        context_len: int = 512,
        vocab_size: int = 64,
        script: Optional[Callable[[SamplingRow], int]] = None,
        drafter: Optional[Callable[[SamplingRow, int, int], DraftTree]] = None,
        step_seconds: Optional[Callable[[StepInput], float]] = None,
        kv_pool: bool = False,
    ):
        # No model and no device memory (kv_cache_bytes and weight_bytes 0); a test that wants the
        # scheduler to overlap steps replaces it (dataclasses.replace(..., supports_overlap=True)).
        self.info = RunnerInfo(
            device="cpu",
            dtype=torch.float32,
            context_len=context_len,
            vocab_size=vocab_size,
            hidden_size=1,
            eos_token_ids=(EOS,),
            max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests,
            attention_backend="none",
            supports_overlap=False,
        )
        self.allocator = TokenAllocator(max_total_tokens, "cpu")
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 1, context_len + 8, "cpu")
        # With `kv_pool`, K/V that a test can follow: each new token's K holds (its id, its position), and
        # every request that samples must find its whole sequence there (what a host tier moves must come back).
        self.kv_pool = KVPool(max_total_tokens, 1, 1, 2, torch.float32, "cpu") if kv_pool else None
        self.script = script or default_script(vocab_size)
        self.drafter = drafter or self._script_chain
        self.steps: list[StepInput] = []
        # A device's time: each step advances `clock` by step_seconds(step) (default: no time at all), so
        # the cost model can be run on the costs a test gives (Speculation.clock = runner.clock).
        self.step_seconds = step_seconds or (lambda step: 0.0)
        self.elapsed = 0.0
        self._in_flight: dict[int, int] = {}  # id(request's output_ids) -> the last decode step's token
        self._last_sampled: list = []
        self._masker = GrammarMasker(vocab_size)
        self._verifier = Verifier(vocab_size)

    def clock(self) -> float:
        return self.elapsed

    def run(self, step: StepInput, prev=None) -> StepOutput:
        self.steps.append(step)
        self.elapsed += self.step_seconds(step)
        # The table writes the model runner would do on its device (the scheduler reads the host mirror).
        rows, positions, slots = step.kv_writes
        self.req_to_token_pool.write_step(
            (torch.from_numpy(rows), torch.from_numpy(positions), torch.from_numpy(slots)), step.kv_writes
        )
        if step.mode.is_verify():
            return self._verify(step)
        if self.kv_pool is not None:
            self._write_and_check_kv(step)
        n = step.batch_size
        out = StepOutput([None] * n, [None] * n, [[] for _ in range(n)])
        for j, (i, row) in enumerate(zip(step.sampling_reqs, step.sampling)):
            if step.prev_src is not None and step.prev_src[step.sample_rows[j]] >= 0:
                # planned ahead: the request's host state lacks the token in flight
                row = _PathRow(row, [self._in_flight[id(row.output_ids)]])
            out.next_token_ids[i] = self._token(row)
        self._in_flight = {
            id(row.output_ids): out.next_token_ids[i] for i, row in zip(step.sampling_reqs, step.sampling)
        }
        self._last_sampled = [out.next_token_ids[i] for i in step.sampling_reqs]  # (what a step ahead reads)
        for lr in step.logprob_rows:  # a flat "distribution": every token at log(1/V)
            lp = -float(torch.log(torch.tensor(float(self.info.vocab_size))))
            if lr.next_token:
                out.output_logprobs[lr.req] = (None, [(lp, 2)][: lr.top_k])
            else:
                out.input_logprobs[lr.req].append((lr.pos, lp, lr.target, None))
        for j, i in enumerate(step.sampling_reqs):
            row = step.sampling[j]
            if row.return_logprob:
                out.output_logprobs[i] = (-1.0, None)
        return out

    def _write_kv(self, step: StepInput) -> torch.Tensor:
        """Each new token's K: (its id, its position in the sequence: a draft's is its depth past the prefix)."""
        assert self.kv_pool is not None
        k = self.kv_pool.k_buffer[0]  # (slots + 1, 1, 2)
        ids = step.token_rows[0].copy()  # (T,)
        if step.prev_src is not None:  # planned past the step in flight: some ids are that step's samples
            ahead = step.prev_src >= 0
            ids[ahead] = np.asarray(self._last_sampled, dtype=np.int64)[step.prev_src[ahead]]
        ids_positions = np.stack([ids, step.token_rows[1]], 1)  # (T, 2)
        k[torch.from_numpy(step.kv_writes[2]), 0] = torch.from_numpy(ids_positions).float()
        return k

    def _write_and_check_kv(self, step: StepInput) -> None:
        assert self.kv_pool is not None
        k = self._write_kv(step)
        if step.prev_src is not None:
            return  # (some input ids are still on the device: nothing to compare with)
        table = step.req_rows if step.mode.is_extend() else step.token_rows[2:4]
        assert table is not None
        for i, row in zip(step.sampling_reqs, step.sampling):
            n = int(table[1][i])
            kv = k[torch.from_numpy(self.req_to_token_pool.host[int(table[0][i]), :n].astype(np.int64)), 0]
            want = (list(row.prompt_ids) + list(row.output_ids))[:n]
            assert kv[:, 1].long().tolist() == list(range(n)), "a request's K/V are not at its positions"
            assert kv[:, 0].long().tolist() == want, "a request's K/V are not its tokens'"

    def _verify(self, step: StepInput) -> StepOutput:
        if step.draft.has_model_drafts:
            for b, by_model in enumerate(step.draft.model_draft):
                if by_model:
                    root = int(step.token_rows[0, int(step.req_rows[4, b])])
                    set_tree(step, b, self.drafter(step.sampling[b], root, step.extend_lens[b]))
            refresh_masks(step)
        if self.kv_pool is not None:
            self._write_kv(step)
        trees = step_trees(step)
        logits = torch.empty(step.num_tokens, self.info.vocab_size)
        at = 0
        for row, tree in zip(step.sampling, trees):
            for node in range(tree.size):
                logits[at] = self._logits(_PathRow(row, tree.path_tokens(node)))
                at += 1
        return self._verifier.accept(step, logits, trees)

    def _script_chain(self, row: SamplingRow, root: int, size: int) -> DraftTree:
        drafts: list[int] = []
        for _ in range(size - 1):
            drafts.append(self.script(_PathRow(row, drafts)))
        return DraftTree.chain(root, drafts)

    def _logits(self, row) -> torch.Tensor:
        """(V,) fake logits preferring the script's token, then lower ids."""
        logits = -torch.arange(self.info.vocab_size, dtype=torch.float32)
        logits[self.script(row)] = 1.0
        return logits

    def launch(self, step: StepInput, prev=None):
        return self.run(step, prev)

    def resolve(self, handle) -> StepOutput:
        return handle

    def _token(self, row: SamplingRow) -> int:
        want = self.script(row)
        if row.grammar is None:
            return want
        # Fake logits that prefer the scripted token, then lower ids; the grammar removes what it forbids.
        logits = -torch.arange(self.info.vocab_size, dtype=torch.float32).unsqueeze(0)
        logits[0, want] = 1.0
        self._masker.apply(logits, [row.grammar])
        return int(logits.argmax())


class _PathRow:
    """A request's sampling row seen after a draft path: the script reads its tokens so far."""

    def __init__(self, row: SamplingRow, path: list[int]):
        self.params, self.prompt_ids, self.grammar = row.params, row.prompt_ids, row.grammar
        self.output_ids = row.output_ids + list(path)
        self.stop_token_ids, self.generator = row.stop_token_ids, row.generator
        self.return_logprob, self.top_logprobs_num = row.return_logprob, row.top_logprobs_num


def fake_scheduler(runner: Optional[FakeRunner] = None, tokenizer=None, **server_args) -> Scheduler:
    """A scheduler driving `runner` (default: a FakeRunner) with `server_args` on top of CPU defaults."""
    args = ServerArgs(model_path="fake", device="cpu", **server_args)
    return Scheduler(args, runner or FakeRunner(), tokenizer)


def submit(s: Scheduler, rid: str, ids: list[int], **sp) -> None:
    """A request of `ids` to scheduler `s` (greedy and to its full length unless `sp` says otherwise)."""
    sp.setdefault("temperature", 0)
    sp.setdefault("ignore_eos", True)
    s.handle_message(TokenizedGenerateReq(list(ids), SamplingParams(**sp), RequestOptions(rid=rid)))


def step(s: Scheduler):
    """One step; the integrity check (queues and slots) holds after it."""
    batch = s.step()
    assert s.check_integrity(), s.last_integrity_error
    return batch


def drain(s: Scheduler, max_steps: int = 500) -> dict:
    """Steps until idle; the final output of every request that ended, by rid."""
    finals = {}
    for _ in range(max_steps):
        step(s)
        for o in s.collect_outputs():
            if o.finished_reason is not None:
                finals[o.rid] = o
        if s.is_idle():
            return finals
    raise AssertionError("the scheduler did not go idle")


def serve_stream(s: Scheduler, runner: FakeRunner, reqs: list[list[int]], every_s: float, out_len: int) -> dict:
    """A stream of arrivals on the runner's clock: request str(i) (prompt `reqs[i]`, greedy, `out_len` tokens,
    streamed) arrives at i * every_s seconds; steps until every one has finished, then checks integrity and that
    every slot comes back. Returns each request's output ids ("ids"), its tokens' clock times ("times") and its
    arrival ("arrival")."""
    arrival: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    ids: dict[str, list[int]] = {}
    while True:
        while len(arrival) < len(reqs) and len(arrival) * every_s <= runner.clock():
            rid, sp = str(len(arrival)), SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=out_len)
            s.handle_message(TokenizedGenerateReq(list(reqs[len(arrival)]), sp, RequestOptions(rid=rid, stream=True)))
            arrival[rid] = len(arrival) * every_s
        s.step()
        for o in s.collect_outputs():
            if o.new_ids:
                times.setdefault(o.rid, []).extend([runner.clock()] * len(o.new_ids))
                ids.setdefault(o.rid, []).extend(o.new_ids)
        if s.is_idle():
            if len(arrival) == len(reqs):
                break
            runner.elapsed = max(runner.elapsed, len(arrival) * every_s)  # nothing runs until the next arrival
    assert s.check_integrity(), s.last_integrity_error
    assert s.handle_message(FlushCacheReq(0)).result is True and s.kv.available() == runner.info.max_total_tokens
    return {"ids": ids, "times": times, "arrival": arrival}
