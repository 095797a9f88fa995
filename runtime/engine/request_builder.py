"""SGLang-style `generate` arguments -> the scheduler's requests.

One prompt or a batch (text or token ids), per-item or shared sampling parameters, logprob options
and request ids become groups of `TokenizedGenerateReq` (a group holds the n samples of one prompt).
Every check that needs no scheduler happens here, so a bad batch is rejected before anything runs.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

from ..io_struct import TokenizedGenerateReq
from ..sampling_params import SamplingParams
from .tokenizer_manager import TokenizerManager, new_rid


def build_requests(tm: TokenizerManager, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                   top_logprobs_num, return_text_in_logprobs, stream, rid, group=None):
    """(groups, is_batch): one list of TokenizedGenerateReq per prompt (its n samples); is_batch says
    whether the caller gave a batch (a list is returned) or one prompt."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt (text) and input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            batch, ids_list = False, [tm.tokenize(prompt)] if prompt else [[]]
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            if not prompt:
                raise ValueError("prompt is an empty list")
            batch, ids_list = True, [tm.tokenize(p) if p else [] for p in prompt]
        else:
            raise ValueError("prompt must be a string or a list of strings")
    else:
        batch, ids_list = _id_lists(input_ids)
    size = len(ids_list)

    def per_item(value, name):
        if isinstance(value, list) and batch:
            if len(value) != size:
                raise ValueError(f"{name} has {len(value)} entries for a batch of {size}")
            return value
        return [value] * size

    sps = per_item(sampling_params, "sampling_params")
    lps = per_item(return_logprob, "return_logprob")
    starts = per_item(logprob_start_len, "logprob_start_len")
    tops = per_item(top_logprobs_num, "top_logprobs_num")
    texts = per_item(return_text_in_logprobs, "return_text_in_logprobs")
    if batch and isinstance(rid, list):
        if len(rid) != size:
            raise ValueError(f"rid has {len(rid)} entries for a batch of {size}")
        rids = rid
    elif batch and isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(size)]
    else:
        rids = [rid] * size
    if not all(r is None or isinstance(r, str) for r in rids):
        raise ValueError("rid must be a string (or a list of strings for a batch)")
    groups = []
    for i in range(size):
        try:
            sp = SamplingParams.from_dict(sps[i])
            warnings = tm.validate(ids_list[i], sp, starts[i], tops[i], bool(lps[i]))
        except ValueError as e:
            if not batch:
                raise
            # NOTE: the whole batch is refused (nothing was submitted); the message says which item to fix.
            raise ValueError(f"batch item {i}: {e}") from None
        base_rid = rids[i] or new_rid()
        members = []
        for k in range(sp.n):
            # One request per sample; with n == 1 the parameters are already the one request's own.
            sub = sp if sp.n == 1 else SamplingParams.from_dict({**sp.to_dict(), "n": 1})
            if sp.seed is not None and k:
                sub.seed = sp.seed + k
            members.append(TokenizedGenerateReq(
                rid=base_rid if sp.n == 1 else f"{base_rid}_{k}", input_ids=ids_list[i], sampling_params=sub,
                return_logprob=bool(lps[i]), logprob_start_len=-1 if starts[i] is None else starts[i],
                top_logprobs_num=tops[i] or 0, return_text_in_logprobs=bool(texts[i]), stream=stream,
                group=group or (base_rid if sp.n > 1 else None), grammar_warnings=warnings))
        groups.append(members)
    all_rids = [m.rid for members in groups for m in members]
    if len(set(all_rids)) != len(all_rids):
        dup = next(r for r in all_rids if all_rids.count(r) > 1)
        raise ValueError(f"duplicate request id {dup!r}")
    return groups, batch


def _id_lists(input_ids) -> tuple[bool, list[list]]:
    """(is_batch, one id list per prompt) from one prompt's ids or a batch of them. Lists, tuples, numpy
    arrays and torch tensors are accepted, with numpy / torch integer scalars as ids (`list(array)`)."""
    if isinstance(input_ids, Mapping):
        # NOTE: transformers 5's apply_chat_template(..., tokenize=True) returns a BatchEncoding, not the ids.
        raise ValueError(f"input_ids must be token ids, got a {type(input_ids).__name__}: pass its ['input_ids']")
    if hasattr(input_ids, "tolist"):  # a numpy array or a torch tensor
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError("input_ids must be a list of ints or a list of lists of ints")
    if input_ids and all(isinstance(x, (list, tuple)) or getattr(x, "ndim", 0) == 1 for x in input_ids):
        return True, [_ints(x) for x in input_ids]
    return False, [_ints(input_ids)]


def _ints(ids) -> list:
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if all(map(int.__instancecheck__, ids)):
        return ids
    try:
        return [operator.index(t) for t in ids]  # numpy / torch integer scalars
    except TypeError:
        return ids  # validate() says what is wrong with them
