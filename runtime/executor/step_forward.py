"""`StepForward`: a step's forward on this device, without sampling.

It owns what every forward of the target model needs: the model, the KV memory it runs over (table, pool,
attention backend), the staging ring its inputs go up through, the kernel choices it runs inside, and the
CUDA graphs once captured (decode steps whole; other steps piecewise, between their attention kernels).
The model runner composes it with sampling (run, launch, verify); a split model's other ranks
(distributed/follower.py) and pipeline stages (distributed/pipeline.py) run it as it is. Every step's
ForwardBatch is built here, by `ForwardBatch.of_step`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..forward_batch import ForwardBatch, ForwardMemory
from ..kernel_choices import KernelChoices
from ..lora.matmul import LoraBatch
from ..lora.slots import LoraSlots
from ..models.llama import LlamaForCausalLM
from ..step import StepInput
from .cuda_graphs import CudaGraphRunner
from .piecewise_graphs import PiecewiseGraphs
from .staging import HostStaging


class StepForward:
    def __init__(
        self,
        model: LlamaForCausalLM,
        memory: ForwardMemory,
        staging: HostStaging,
        kernel_choices: KernelChoices,
        lora: Optional[LoraSlots] = None,
    ):
        self.model = model  # (every model plait runs is one: Qwen's subclass it)
        self.memory = memory
        self.staging = staging
        # Every forward and graph capture runs inside these (kernel_choices.py): the doors that run a
        # step enter them (`using_kernels`).
        self.kernel_choices = kernel_choices
        self.graphs: Optional[CudaGraphRunner] = None  # decode CUDA graphs (GPU), set once captured
        self.piecewise: Optional[PiecewiseGraphs] = None  # other steps' graphs between attention kernels (GPU)
        self.lora = lora  # LoRA adapters' device slots (with enable_lora)

    def batch(self, step: StepInput, input_ids: Optional[torch.Tensor] = None) -> ForwardBatch:
        """The step's ForwardBatch, its new tokens' kv slots written into the table (`ForwardBatch.of_step`);
        with the step's LoRA adapters, those it brings copied into their slots first."""
        fb = ForwardBatch.of_step(step, self.memory, self.staging, input_ids)
        if self.write_adapters(step):
            assert self.lora is not None and step.lora is not None  # (write_adapters checked both)
            tokens = [1] * step.batch_size if step.mode.is_decode() else step.extend_lens
            fb.lora = LoraBatch.of_rows(self.lora, step.lora.slots, tokens)
        return fb

    def write_adapters(self, step: StepInput) -> bool:
        """The adapters `step` brings copied into their slots (before its forward, graph or not); whether
        the step has LoRA adapters at all."""
        if step.lora is None:
            return False
        assert self.lora is not None, "a step with LoRA adapters on a runner without enable_lora"
        for slot, adapter in step.lora.loads:
            self.lora.write(slot, adapter)
        return True

    def prepared(self, step: StepInput) -> ForwardBatch:
        """The step's ForwardBatch with its attention metadata: for a caller that runs the model itself
        (a pipeline stage)."""
        fb = self.batch(step)
        self.memory.attn_backend.init_forward_metadata(fb)
        return fb

    def replay_graph(self, fb: ForwardBatch) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """A decode step as its CUDA graph, which computes every row's logits and their argmax:
        (logits (B, vocab) float32, greedy ids (B,)); None where no graph runs the batch."""
        if self.graphs is None or not self.graphs.can_run(fb):
            return None
        return self.graphs.replay(fb)

    def hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on `fb` without a graph: (T, hidden) final states."""
        self.memory.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    def logits(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on `fb` without a graph, and every row's logits: (T, vocab) float32."""
        return self.model.compute_logits(self.hidden(fb))

    def eager(self, fb: ForwardBatch, sample_rows: list[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The model on `fb` without a graph: (T, hidden) states and the (S,) device rows to sample."""
        self.memory.attn_backend.init_forward_metadata(fb)
        # NOTE: the rows to sample are uploaded before the forward is queued: an upload from a Python list
        # after it waits for the whole forward (a pageable copy syncs the stream), and only then could
        # the LM head and the sampling be queued.
        rows = self.upload_rows(sample_rows)
        if self.piecewise is not None and self.piecewise.can_run(fb):
            return self.piecewise.run(fb), rows
        return self.model(fb.input_ids, fb.positions, fb), rows  # (T, hidden), (S,)

    def upload_rows(self, rows: list[int]) -> Optional[torch.Tensor]:
        """(S,) int64 device rows of a host list (through the staging ring); None for no rows."""
        return self.staging.upload([rows])[0] if rows else None
