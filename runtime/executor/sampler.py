"""Batched sampling: logit bias, penalties, min_new_tokens, grammar masks, temperature, top-k/top-p/min-p.

`SamplingBatchInfo` turns the per-request parameters into tensors once per step; `sample()` picks one
token per row. A batch that is entirely greedy and unconstrained by penalties takes the argmax fast
path. Requests with a `seed` draw from their own generator, so their output reproduces exactly.
`StepSampler` samples a whole step: its logits rows, grammar masks, logprobs, into a `StepOutput`.

Semantics (pinned against a float64 reference by tests/request/test_sampling_semantics.py):
- order: logit_bias, repetition_penalty, frequency/presence penalties, min_new_tokens bans (vLLM's
  order), grammar mask, then temperature, then top-k / top-p / min-p on the tempered probabilities;
- repetition_penalty (HF/vLLM): a logit of a token seen in the prompt or the output is divided by the
  penalty when positive, multiplied by it otherwise; frequency/presence (OpenAI) subtract
  `f * count + p * (count > 0)` over the output tokens only;
- temperature <= 1e-6 or top_k == 1 is greedy (argmax of the adjusted logits, first index on ties);
- top-k, top-p and min-p are applied jointly to the same tempered distribution, as SGLang does: top-p's
  nucleus is measured on the probabilities before top-k renormalizes them (vLLM and HF renormalize
  after top-k first; the two differ only when top_k and top_p are both set);
- top-p keeps the smallest prefix of the sorted probabilities whose mass reaches top_p; min-p keeps
  tokens with probability >= min_p * the largest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..constrained.bitmask import bits_at, set_bits
from ..constrained.masker import GrammarMasker
from ..step import SamplingRow, StepInput, StepOutput
from ..uploads import to_device

# The LM head: final hidden states (N, hidden) -> logits (N, vocab) float32.
ComputeLogits = Callable[[torch.Tensor], torch.Tensor]
# Some of the LM head: hidden states (N, hidden) and token ids (n,) -> those tokens' logits (N, n) float32.
LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# On the CPU, a step whose rows are all greedy and narrowed by a grammar to at most this many tokens each is
# scored on the union of those tokens alone (a VERIFY step: each such node, executor/verify.py): the LM
# head's rows for them, where the whole head is a pass over every token's weights (a fifth of a small
# model's). Digits, a date's dashes, a label's first tokens.
NARROW_TOKENS = 256


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # (B, 1) float32, 1.0 for greedy rows (unused there)
    top_ps: torch.Tensor  # (B,)
    top_ks: torch.Tensor  # (B,) int64, vocab size where disabled
    min_ps: torch.Tensor  # (B,)
    greedy: torch.Tensor  # (B,) bool
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    need_penalties: bool
    need_logit_bias: bool
    need_min_tokens: bool
    has_grammar: bool
    has_seed: bool

    @classmethod
    def from_rows(
        cls, rows: list[SamplingRow], vocab_size: int, device: Union[str, torch.device]
    ) -> "SamplingBatchInfo":
        sps = [r.params for r in rows]
        greedy = [sp.is_greedy for sp in sps]
        top_ks = [vocab_size if sp.top_k < 0 else min(sp.top_k, vocab_size) for sp in sps]
        # One (B, 5) upload for the per-row parameters (top_k as a float32 is exact below 2^24).
        params = _upload(
            [
                [1.0 if g else float(sp.temperature), float(sp.top_p), float(sp.min_p), float(k), float(g)]
                for sp, g, k in zip(sps, greedy, top_ks)
            ],
            torch.float32,
            device,
        ).view(len(sps), 5)
        return cls(
            temperatures=params[:, 0:1],
            top_ps=params[:, 1],
            top_ks=params[:, 3].long(),
            min_ps=params[:, 2],
            greedy=params[:, 4].bool(),
            all_greedy=all(greedy),
            need_top_p=any(sp.top_p < 1.0 for sp, g in zip(sps, greedy) if not g),
            need_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy) if not g),
            need_min_p=any(sp.min_p > 0 for sp, g in zip(sps, greedy) if not g),
            need_penalties=any(r.penalized for r in rows),
            need_logit_bias=any(sp.logit_bias for sp in sps),
            need_min_tokens=any(r.min_tokens_pending() for r in rows),
            has_grammar=any(r.grammar is not None for r in rows),
            has_seed=any(sp.seed is not None and not g for sp, g in zip(sps, greedy)),
        )


def _upload(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the step in flight (uploads.py)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) int64 argmax, first index on ties. On CUDA a two-stage Triton kernel: torch's
    single-block reduction over a 128k vocabulary costs about a layer's worth of small ops."""
    if logits.is_cuda and logits.shape[0] > 0 and logits.stride(-1) == 1:
        from ..kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def apply_logit_adjustments(logits: torch.Tensor, rows: list[SamplingRow], info: SamplingBatchInfo) -> None:
    """In place on logits (B, V): bias, penalties, and EOS/stop-token bans before min_new_tokens."""
    vocab = logits.shape[1]
    if info.need_logit_bias:
        # One upload for every biased (row, token) pair: this runs in overlapped steps too.
        at, ids, vals = [], [], []
        for i, r in enumerate(rows):
            for tok, val in (r.params.logit_bias or {}).items():
                at.append(i)
                ids.append(int(tok))
                vals.append(float(val))
        if at:
            logits.index_put_(
                (_upload(at, torch.int64, logits.device), _upload(ids, torch.int64, logits.device)),
                _upload(vals, torch.float32, logits.device).to(logits.dtype),
                accumulate=True,
            )
    if info.need_penalties:
        for i, r in enumerate(rows):
            sp = r.params
            # NOTE: the multiplicative penalty first, then the additive ones (vLLM's order): the sign that
            # picks divide-or-multiply is the logit's own, not one the additive penalties already moved.
            if sp.repetition_penalty != 1.0:
                seen = _upload(sorted(set(r.prompt_ids).union(r.output_ids)), torch.int64, logits.device)
                seen_logits = logits[i, seen]
                logits[i, seen] = torch.where(
                    seen_logits > 0, seen_logits / sp.repetition_penalty, seen_logits * sp.repetition_penalty
                )
            if sp.frequency_penalty or sp.presence_penalty:
                if r.output_ids:
                    out = _upload(r.output_ids, torch.int64, logits.device)
                    counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
                    logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)
    if info.need_min_tokens:
        for i, r in enumerate(rows):
            if r.min_tokens_pending() and r.stop_token_ids:
                ban = _upload(sorted(r.stop_token_ids), torch.int64, logits.device)
                logits[i, ban] = float("-inf")


def sample(logits: torch.Tensor, rows: list[SamplingRow], info: SamplingBatchInfo) -> torch.Tensor:
    """logits (B, V) float32, already adjusted and masked → next token ids (B,) int64."""
    if info.all_greedy:
        return greedy_tokens(logits)
    sampled = _draw(sampling_probs(logits, info), rows, info)
    return torch.where(info.greedy, greedy_tokens(logits), sampled)


def sampling_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """logits (B, V), already adjusted → the (B, V) distribution each sampled row draws from:
    temperature, then top-k / top-p / min-p, renormalized. (Greedy rows' rows are not meaningful.)"""
    # NOTE: a logit near float32's limit (a logit_bias up to 1e38) divided by a small temperature
    # overflows to inf, and softmax turns a row holding inf into NaNs (inf - inf), which the draw reads
    # as token 0. Clamped to the largest float, that token keeps all the mass, as its bias asks.
    scaled = (logits / info.temperatures).clamp_(max=torch.finfo(logits.dtype).max)  # (B, V)
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = _filter_probs(probs, info)
    return probs


def _filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if info.need_top_k:
        ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
        keep &= ranks < info.top_ks[:, None]
    if info.need_top_p:
        # Keep a token while the mass strictly before it is below top_p (the first token always stays).
        # NOTE: a float32 cumsum over a large vocabulary reaches 1.0 before its tail, so a top_p = 1 row
        # (batched with a top_p < 1 one) would lose thousands of tail tokens: those rows skip the test.
        keep &= ((sorted_p.cumsum(dim=-1) - sorted_p) < info.top_ps[:, None]) | (info.top_ps[:, None] >= 1.0)
    if info.need_min_p:
        keep &= sorted_p >= info.min_ps[:, None] * sorted_p[:, :1]
    sorted_p = sorted_p * keep
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def _draw(probs: torch.Tensor, rows: list[SamplingRow], info: SamplingBatchInfo) -> torch.Tensor:
    """One token per row of probs (B, V) in proportion to it: argmax of probs / q with q ~ Exp(1), the
    way torch.multinomial(probs, 1) draws one sample (on the CPU the very same tokens for the same
    generator state: a test checks it), without its host-side check of the probabilities, which is a
    device sync in every sampled step."""
    if not info.has_seed:
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for i, r in enumerate(rows):
        gen: Optional[torch.Generator] = r.generator
        out[i] = (probs[i] / torch.empty_like(probs[i]).exponential_(generator=gen)).argmax()
    return out


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Raw-model logprobs of `token_ids` (N,) under logits (N, V); plus top-k (values, ids) if top_k > 0.

    NOTE: the model runner passes the logits before bias, penalties, grammar mask and temperature:
    log-softmax of the raw logits, as vLLM's default `raw_logprobs` does (SGLang's default reports the
    log of the distribution it samples from: after penalties, bias and temperature, top-p renormalized;
    greedy rows there are the log-softmax of the adjusted logits)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    if top_k > 0:
        vals, ids = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)
        return chosen, vals, ids
    return chosen, None, None


def _narrowable(row: SamplingRow) -> bool:
    """Whether the row's token is its grammar's argmax of the raw logits and nothing else (greedy, no
    logprobs, no bias, penalty or ban): its logits outside what the grammar allows are never read."""
    sp = row.params
    return (
        row.grammar is not None
        and sp.is_greedy
        and not row.return_logprob
        and not sp.logit_bias
        and not row.penalized
        and not row.min_tokens_pending()
    )


@dataclass
class NarrowLogits:
    """A step's logits at the tokens its rows' grammars allow, and nowhere else (-inf there)."""

    ids: torch.Tensor  # (n,) int64, ascending: every token some row allows
    values: torch.Tensor  # (S, n) float32: each row's logits at `ids`
    vocab_size: int

    def row(self, i: int) -> torch.Tensor:
        """Row i as whole logits (V,) float32 (what a matcher's `refine_bitmask` reads)."""
        logits = torch.full((self.vocab_size,), float("-inf"), dtype=torch.float32)
        logits[self.ids] = self.values[i]
        return logits

    def greedy(self, bitmask: torch.Tensor) -> torch.Tensor:
        """(S,) int64: each row's argmax among the tokens its bits (S, W) allow (first on ties; token 0 where
        a row allows none, as the argmax of a row of -inf is)."""
        allowed = bits_at(bitmask, self.ids)  # (S, n)
        best = self.ids[self.values.masked_fill(~allowed, float("-inf")).argmax(dim=1)]  # (S,)
        return torch.where(allowed.any(dim=1), best, torch.zeros_like(best))


def _narrow_logits(
    states: torch.Tensor, logits_at: LogitsAt, bitmask: torch.Tensor, vocab_size: int
) -> Optional[NarrowLogits]:
    """The model's logits at every token the masks `bitmask` (S, W) allow, from the head's rows of those tokens
    alone; None where a row allows more than NARROW_TOKENS (then the whole head is cheaper than the gather).
    Reads the masks' nonzero words only: a row allowing a few tokens costs a few words, not the vocabulary."""
    if int((bitmask != 0).sum(dim=1).max()) > NARROW_TOKENS:  # a bit at least in each nonzero word
        return None
    rows, ids = set_bits(bitmask)
    if int(torch.bincount(rows, minlength=bitmask.shape[0]).max()) > NARROW_TOKENS:
        return None
    ids = torch.unique(ids)  # (n,) sorted
    ids = ids[ids < vocab_size]
    return NarrowLogits(ids, logits_at(states, ids), vocab_size)  # values (S, n)


class StepSampler:
    """A step's tokens (and the logprobs its requests asked for) from its hidden states or logits. Owns
    the grammar masker, made for the first constrained step."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._masker: Optional[GrammarMasker] = None

    def sample_step(
        self,
        step: StepInput,
        compute_logits: ComputeLogits,
        hidden: Optional[torch.Tensor],
        logits: Optional[torch.Tensor] = None,
        greedy: Optional[torch.Tensor] = None,
        sample_rows_t: Optional[torch.Tensor] = None,
        logits_at: Optional[LogitsAt] = None,
    ) -> StepOutput:
        """The step's output, read back. `hidden` (T, hidden): the forward's states, whose rows
        `sample_rows_t` ((S,) on the device) the LM head turns into logits; or `logits` (S, V) computed
        already (a decode graph), with their argmax `greedy` (S,). `logits_at`: the head at some tokens
        (the model's `logits_at`, one device), for rows a grammar narrows (`_narrow_logits`)."""
        n = step.batch_size
        out = StepOutput(next_token_ids=[None] * n, output_logprobs=[None] * n, input_logprobs=[[] for _ in range(n)])
        if step.logprob_rows:  # (EXTEND steps only: always run eagerly, with their hidden states)
            assert hidden is not None
            self._prompt_logprobs(step, compute_logits, hidden, out)
        if not step.sample_rows:
            return out
        rows = step.sampling
        bitmask = None  # (S, W) the grammar masks, when filled before the logits
        if logits is None:
            assert hidden is not None and sample_rows_t is not None
            states = hidden[sample_rows_t]  # (S, hidden)
            if logits_at is not None and not states.is_cuda and all(_narrowable(r) for r in rows):
                masker = self._grammar_masker()
                grammars = [r.grammar for r in rows]
                bitmask = masker.fill(grammars, len(rows))
                narrow = _narrow_logits(states, logits_at, bitmask, self.vocab_size)
                if narrow is not None:
                    # Greedy rows with nothing else adjusting their logits: the argmax under the (refined)
                    # masks, read on the allowed tokens alone, never on (S, V) tensors.
                    masker.refine(grammars, bitmask, narrow.row)
                    next_list = narrow.greedy(bitmask).tolist()
                    for j, i in enumerate(step.sampling_reqs):
                        out.next_token_ids[i] = next_list[j]
                    return out
            if logits is None:
                logits = compute_logits(states)  # (S, V)
        want_lp = [r.return_logprob for r in rows]
        raw_logits = logits.clone() if any(want_lp) else None
        if all(r.plain_greedy() for r in rows):
            # NOTE: the common case pays for no sampling tensors (each is a host-to-device copy).
            next_ids = greedy if greedy is not None else greedy_tokens(logits)
        else:
            info = SamplingBatchInfo.from_rows(rows, logits.shape[1], logits.device)
            apply_logit_adjustments(logits, rows, info)
            if info.has_grammar:
                self._grammar_masker().apply(logits, [r.grammar for r in rows], bitmask)
            next_ids = sample(logits, rows, info)
        if raw_logits is not None:
            top_k = max(r.top_logprobs_num for r in rows)
            chosen_t, top_v_t, top_i_t = compute_logprobs(raw_logits, next_ids, top_k)
            chosen = chosen_t.tolist()
            top_v = top_v_t.tolist() if top_v_t is not None else None
            top_i = top_i_t.tolist() if top_i_t is not None else None
        next_list = next_ids.tolist()
        for j, i in enumerate(step.sampling_reqs):
            out.next_token_ids[i] = next_list[j]
            if raw_logits is not None and want_lp[j]:
                k = rows[j].top_logprobs_num
                top = list(zip(top_v[j][:k], top_i[j][:k])) if (k and top_v is not None and top_i is not None) else None
                out.output_logprobs[i] = (chosen[j], top)
        return out

    @staticmethod
    def sample_on_device(
        logits: torch.Tensor, rows: list[SamplingRow], plain_greedy: bool, greedy: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """(B,) int64 next ids of logits (B, V), without reading anything back (no grammar here: a
        launched step's rows need nothing from the host)."""
        if plain_greedy:
            return greedy if greedy is not None else greedy_tokens(logits)
        info = SamplingBatchInfo.from_rows(rows, logits.shape[1], logits.device)
        apply_logit_adjustments(logits, rows, info)
        return sample(logits, rows, info)

    @staticmethod
    def _prompt_logprobs(step: StepInput, compute_logits: ComputeLogits, hidden: torch.Tensor, out: StepOutput) -> None:
        lp_rows = step.logprob_rows
        rows = torch.tensor([lr.row for lr in lp_rows], dtype=torch.int64, device=hidden.device)
        # (a next-token row has no target: 0 stands in, its logprob is not reported)
        targets = torch.tensor([lr.target for lr in lp_rows], dtype=torch.int64, device=hidden.device)
        top_k = max(lr.top_k for lr in lp_rows)
        chosen_t, top_v_t, top_i_t = compute_logprobs(compute_logits(hidden[rows]), targets, top_k)
        chosen = chosen_t.tolist()
        top_v = top_v_t.tolist() if top_v_t is not None else None
        top_i = top_i_t.tolist() if top_i_t is not None else None
        for j, lr in enumerate(lp_rows):
            k = lr.top_k
            top = list(zip(top_v[j][:k], top_i[j][:k])) if (k and top_v is not None and top_i is not None) else None
            if lr.next_token:
                out.output_logprobs[lr.req] = (None, top)  # the next token's distribution, no token
            else:
                out.input_logprobs[lr.req].append((lr.pos, chosen[j], lr.target, top))

    def _grammar_masker(self) -> GrammarMasker:
        if self._masker is None:
            self._masker = GrammarMasker(self.vocab_size)
        return self._masker
