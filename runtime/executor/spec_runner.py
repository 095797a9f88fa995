"""The draft-and-verify step runner: the target's ModelRunner and a drafter (a STANDALONE draft model or an
EAGLE head), behind the scheduler's StepRunner seam.

Every step runs on the target as usual, then the drafter sees it (its KV in lockstep with the target's:
speculative/draft_batch.py); a VERIFY step whose requests the scheduler left to the runner is drafted
first. Steps are never launched ahead (`supports_overlap` False): a drafter's next step reads what the
one before committed.

`create_step_runner` builds the runner the settings ask for: a plain ModelRunner without a drafter, or
rank 0 of a model split over ranks (runtime/distributed/). With a split target the drafter runs whole on
rank 0 beside its shard: its drafts are in the VERIFY step rank 0 plans, which every rank scores (the
other ranks never see the drafter); an EAGLE head reads the target's hidden states, which every rank
holds whole, and looks up tokens and scores drafts through rank 0's whole copy of the target's embedding
and LM head (`WholeVocabulary`). Start-up refuses a draft model or head that cannot draft for the target
(another tokenizer or vocabulary, another hidden size), with the reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from ..attention import AttentionContext, AttentionHeads, create_attention_backend
from ..kvcache.memory_pool import KVPool
from ..models.config import ModelConfig
from ..server_args import ServerArgs
from ..speculative.draft_batch import DraftMemory
from ..speculative.draft_model import DraftModelDrafter
from ..speculative.drafter import Drafter
from ..speculative.eagle import EagleDrafter
from ..speculative.eagle_head import EagleHead, HeadConfig
from ..step import StepInput, StepOutput
from .loader import _iter_safetensors, load_model, load_model_config, load_tokenizer, safetensors_files
from .model_runner import ModelRunner, model_dtype
from .staging import HostStaging
from .target_runner import TargetRunner

logger = logging.getLogger(__name__)


class SpecRunner:
    def __init__(self, target: TargetRunner, drafter: Drafter):
        self.target = target
        self.drafter = drafter
        # The target's facts (its memory only: a drafter's weights and KV are not counted), never launched ahead.
        self.info = replace(target.info, supports_overlap=False)
        self.allocator, self.req_to_token_pool = target.allocator, target.req_to_token_pool
        self.kv_pool = target.kv_pool  # (the target's: the drafter's own is not the scheduler's to copy)

    def run(self, step: StepInput, prev=None) -> StepOutput:
        # (`prev` is always None: no step is launched ahead of a drafter's)
        d = self.drafter
        if step.mode.is_verify():
            if step.draft.has_model_drafts:
                d.draft(step)
            out, hidden, fb = self.target.run_verify(step, d.capture_layers)
            d.after_verify(step, out, hidden, fb)
            return out
        if d.needs_hidden:
            out, hidden, fb = self.target.run_with_hidden(step, d.capture_layers)
            d.observe(step, out, hidden, fb)
            return out
        out = self.target.run(step)
        d.observe(step, out)
        return out

    def launch(self, step: StepInput, prev=None) -> StepOutput:
        return self.run(step)

    def resolve(self, handle: StepOutput) -> StepOutput:
        return handle


def create_step_runner(
    server_args: ServerArgs, model_path: str, make_target: Optional[Callable[[int], TargetRunner]] = None
) -> Any:
    """The scheduler's step runner: the target's, with a drafter when the algorithm has one.
    `make_target(extra_kv_bytes_per_token)` builds the target's runner, its KV pool sized beside a
    drafter's pool of the same slots: one device's ModelRunner by default; the scheduler passes rank 0's
    of a split model (distributed/runner.py, which starts the other ranks)."""
    if make_target is None:

        def make_target(extra: int) -> ModelRunner:
            return ModelRunner(server_args, model_path, extra_kv_bytes_per_token=extra)

    algo = server_args.speculative_algorithm
    if algo not in ("STANDALONE", "EAGLE", "EAGLE3"):
        runner = make_target(0)
        if algo is not None:  # drafts from the host (NGRAM): the target verifies them
            runner.capture_verify_graphs(*_verify_graph_shape(server_args))
        return runner
    steps, topk, nodes = server_args.speculative_shape()
    draft_path = server_args.speculative_draft_model_path
    if not os.path.isdir(draft_path):
        raise ValueError(f"speculative_draft_model_path {draft_path!r} is not a folder")
    target_cfg = load_model_config(model_path, server_args.load_format)
    device = server_args.resolved_device()
    dtype = model_dtype(server_args, target_cfg.checkpoint_dtype)
    context_len = target_cfg.resolve_context_length(server_args.context_length)
    if algo == "STANDALONE":
        draft_cfg = load_model_config(draft_path, "auto")
        _check_same_vocabulary(server_args, model_path, target_cfg, draft_path, draft_cfg)
        model = load_model(draft_path, draft_cfg, "auto", dtype, device, context_len, server_args.random_seed)
        kv_shape = (draft_cfg.num_hidden_layers, draft_cfg.num_key_value_heads, draft_cfg.head_dim)
        scratch = DraftModelDrafter.scratch_per_row(steps, topk)
    else:
        hc = HeadConfig.from_folder(draft_path, algo, target_cfg)
        model = _load_head(hc, draft_path, dtype, device, context_len)
        draft_cfg = hc.model
        kv_shape = (model.num_kv_layers, draft_cfg.num_key_value_heads, draft_cfg.head_dim)
        scratch = EagleDrafter.scratch_per_row(steps, topk)
    # NOTE: the target sizes its pool after the drafter's weights are loaded, for the two pools' bytes per
    # token together: the drafter's pool has the target's slots (draft_batch.py).
    # (an EAGLE head beside a split target: rank 0's whole embedding and LM head, read before the pool is sized)
    whole = (
        WholeVocabulary.read(model_path, target_cfg, server_args.load_format, dtype, device)
        if algo != "STANDALONE" and server_args.world_size() > 1
        else None
    )
    target = make_target(KVPool.bytes_per_token(*kv_shape, dtype))
    rows = target.info.max_running_requests + 1
    slots = target.info.max_total_tokens
    pool = KVPool(slots + rows * scratch, *kv_shape, dtype, device)
    # The drafter's own attention backend (the target's kind), over its own pool: the whole draft model
    # or head on this device, whatever the target's split.
    heads = AttentionHeads.split(draft_cfg.num_attention_heads, draft_cfg.num_key_value_heads, draft_cfg.head_dim)
    attention = AttentionContext(device, heads, dtype, pool.num_slots, server_args.disable_cascade_attention)
    backend = create_attention_backend(target.info.attention_backend, attention)
    memory = DraftMemory(pool, target.req_to_token_pool, backend, slots, scratch, device, HostStaging(device))
    drafter: Drafter
    if algo == "STANDALONE":
        drafter = DraftModelDrafter(model, memory, steps, topk, nodes)
    else:
        model.attach_target(whole or target.model)
        drafter = EagleDrafter(model, memory, steps, topk, nodes, rows)
    target.capture_verify_graphs(*_verify_graph_shape(server_args), drafter.capture_layers)
    logger.info(
        "speculative decoding: %s drafter from %s (steps %d, top-k %d, %d tokens per verify)",
        algo,
        draft_path,
        steps,
        topk,
        nodes,
    )
    return SpecRunner(target, drafter)


def _verify_graph_shape(sa: ServerArgs) -> tuple[int, int]:
    """(tokens per request, requests) of the verify steps a target captures CUDA graphs for, where it runs
    decode steps as graphs (a GPU; not a split model, whose other ranks score verify steps eagerly): up
    to the batch size speculation runs at."""
    return sa.speculative_shape()[2], sa.resolved_speculative_disable_by_batch_size()


class WholeVocabulary:
    """Rank 0's whole copy of a split target's embedding and LM head, for an EAGLE head beside it. The
    target's own are split over the ranks: a lookup or a logits row there is a collective that the other
    ranks, which never draft, would not join."""

    def __init__(self, embedding: torch.Tensor, head: torch.Tensor):
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embedding, freeze=True)
        self.head = head  # (vocab, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.to(self.head.dtype) @ self.head.t()).float()  # (N, vocab) float32

    @classmethod
    def read(
        cls, model_path: str, cfg: ModelConfig, load_format: str, dtype: torch.dtype, device: str
    ) -> "WholeVocabulary":
        """From the target's checkpoint, those two tensors alone (random with dummy weights: the drafts are
        then guesses, as with any dummy drafter, and verification keeps the output the target's)."""
        if load_format == "dummy":
            g = torch.Generator().manual_seed(0)
            embedding = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02
            head = (
                embedding
                if cfg.tie_word_embeddings
                else torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02
            )
        else:
            from safetensors import safe_open

            found = {}
            for f in safetensors_files(model_path):
                with safe_open(f, framework="pt") as st:
                    for name in st.keys():
                        if name in ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight"):
                            found[name.removeprefix("model.")] = st.get_tensor(name)
            if "embed_tokens.weight" not in found:
                raise ValueError(
                    f"speculative_algorithm EAGLE with tp_size > 1 reads the target's embedding from "
                    f"its checkpoint, and {model_path!r} has no model.embed_tokens.weight"
                )
            embedding = found["embed_tokens.weight"]
            head = found.get("lm_head.weight", embedding)  # none: tied to the embedding
        embedding = embedding.to(dtype=dtype, device=device)
        return cls(embedding, embedding if head is embedding else head.to(dtype=dtype, device=device))


def _check_same_vocabulary(
    sa: ServerArgs, model_path: str, target: ModelConfig, draft_path: str, draft: ModelConfig
) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model in {draft_path!r} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target.vocab_size}: STANDALONE drafts need the target's tokenizer"
        )
    draft_tok = load_tokenizer(draft_path)
    target_tok = load_tokenizer(sa.tokenizer_path or model_path)
    if draft_tok is None or target_tok is None:
        return  # token ids only (a built-in shape or a bare folder): the vocabulary sizes agree
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(
            f"the draft model in {draft_path!r} has another tokenizer than the target: its token ids "
            f"mean other text, so its drafts would never be accepted"
        )


def _load_head(hc: HeadConfig, path: str, dtype: torch.dtype, device: str, context_len: int) -> EagleHead:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(hc, context_len)
    finally:
        torch.set_default_dtype(old)
    head.load_weights(_iter_safetensors(safetensors_files(path)), source=path)
    return head.to(dtype=dtype, device=device).eval()
