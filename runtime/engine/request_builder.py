"""SGLang-style `generate` arguments -> the scheduler's requests.

One prompt or a batch (text or token ids), per-item or shared sampling parameters and request options
(logprobs, stream, rid, group: a `RequestOptions` per prompt) become one `PromptRequests` per prompt: its
`TokenizedGenerateReq`s (the n samples of the prompt, from `expand_samples`). A `SamplingParams` or a
`RequestOptions` the caller built is used as it is (not rebuilt, and not verified again). Every check
that needs no scheduler happens here, so a bad batch is rejected before anything runs.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ..io_struct import TokenizedGenerateReq
from ..request_options import RequestOptions, expand_samples, new_rid
from ..sampling_params import SamplingParams
from .tokenizer_manager import TokenizerManager

# Engine.generate's request options and their defaults; those a batch may give per item.
OPTION_DEFAULTS: dict[str, Any] = {
    "return_logprob": False,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "rid": None,
    "group": None,
    "lora_path": None,
}
PREFILL_ONLY = SamplingParams(max_new_tokens=0)  # the shared prompt of n samples, prefilled once
_PER_ITEM = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "lora_path")


@dataclass
class PromptRequests:
    """One prompt's requests to the scheduler (its n samples, or the request itself when n == 1) and the
    warnings validating it gave (its constraint's, the same for every sample)."""

    samples: list[TokenizedGenerateReq]
    grammar_warnings: list[str]


def build_requests(
    tm: TokenizerManager,
    prompt,
    sampling_params,
    input_ids,
    option_args: dict[str, Any],
    options: Optional[RequestOptions] = None,
    image_data=None,
):
    """(prompts, is_batch): one PromptRequests per prompt; is_batch says whether the caller gave a batch (a
    list is returned) or one prompt. The options are `options` when given (its rid suffixed `_i` per batch
    item), else built from `option_args` (Engine.generate's). `image_data`: a vision model's images (one
    prompt: an image or a list of them; a batch: that per prompt), loaded and preprocessed here."""
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

    images: list[tuple] = [()] * size
    if image_data is not None:
        ids_list, images = _with_images(tm, ids_list, image_data, batch)
    sps = per_item(sampling_params, "sampling_params")
    item_args = _item_option_args(option_args, options, size, batch, per_item)
    groups = []
    for i in range(size):
        try:
            sp = SamplingParams.from_dict(sps[i])
            opts = RequestOptions.of(**item_args[i]) if options is None else options.with_rid(item_args[i]["rid"])
            warnings = tm.validate(ids_list[i], sp, opts)
        except ValueError as e:
            if not batch:
                raise
            # NOTE: the whole batch is refused (nothing was submitted); the message says which item to fix.
            raise ValueError(f"batch item {i}: {e}") from None
        if opts.rid is None:
            opts = opts.with_rid(new_rid())
        samples = [TokenizedGenerateReq(ids_list[i], s, o, images[i]) for s, o in expand_samples(sp, opts)]
        groups.append(PromptRequests(samples, warnings))
    all_rids = [m.rid for group in groups for m in group.samples]
    if len(set(all_rids)) != len(all_rids):
        dup = next(r for r in all_rids if all_rids.count(r) > 1)
        raise ValueError(f"duplicate request id {dup!r}")
    return groups, batch


def _with_images(tm: TokenizerManager, ids_list: list[list], image_data, batch: bool) -> tuple[list[list], list[tuple]]:
    """Each prompt's ids with its image placeholders expanded, and its images (`PromptImages.prepare`)."""
    if tm.images is None:
        raise ValueError("image_data was given, but this model takes no images (a text-only model)")
    if batch:
        if not isinstance(image_data, (list, tuple)) or len(image_data) != len(ids_list):
            raise ValueError(
                f"image_data must give one entry (an image, a list of them or None) per prompt of the "
                f"batch of {len(ids_list)}"
            )
        per_prompt = image_data
    else:
        per_prompt = [image_data]
    ids_out, images = [], []
    for i, (ids, item) in enumerate(zip(ids_list, per_prompt)):
        item = [] if item is None else list(item) if isinstance(item, (list, tuple)) else [item]
        try:
            expanded, prompt_images = tm.images.prepare(ids, item) if item else (ids, ())
        except ValueError as e:
            raise ValueError(f"batch item {i}: {e}" if batch else str(e)) from None
        ids_out.append(expanded)
        images.append(prompt_images)
    return ids_out, images


def _item_option_args(
    option_args: dict[str, Any], options: Optional[RequestOptions], size: int, batch: bool, per_item
) -> list[dict[str, Any]]:
    """Each batch item's RequestOptions.of arguments (with `options` given: only each item's rid)."""
    if options is not None:
        given = [k for k, v in option_args.items() if v != OPTION_DEFAULTS[k]]
        if given:
            raise ValueError(f"options replaces {', '.join(given)}: give one or the other")
        option_args = {"rid": options.rid}
    columns = {k: per_item(option_args[k], k) for k in _PER_ITEM if k in option_args}
    rid = option_args.get("rid")
    if batch and isinstance(rid, list):
        if len(rid) != size:
            raise ValueError(f"rid has {len(rid)} entries for a batch of {size}")
        rids = rid
    elif batch and isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(size)]
    else:
        rids = [rid] * size
    shared = {k: option_args[k] for k in ("stream", "group") if k in option_args}
    return [{**shared, **{k: column[i] for k, column in columns.items()}, "rid": rids[i]} for i in range(size)]


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


def single_stream(prompts: list[PromptRequests], batch: bool) -> tuple[TokenizedGenerateReq, list[str]]:
    """The one request of a stream, and its warnings: a stream takes one prompt with n == 1."""
    if batch or len(prompts) != 1 or len(prompts[0].samples) != 1:
        raise ValueError("stream=True takes a single prompt with n=1")
    return prompts[0].samples[0], prompts[0].grammar_warnings


def streamed(options: Optional[RequestOptions]) -> RequestOptions:
    if options is None:
        return RequestOptions(stream=True)
    return options if options.stream else dataclasses.replace(options, stream=True)
