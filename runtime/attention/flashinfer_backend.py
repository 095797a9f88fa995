"""flashinfer: an optional attention backend on FlashInfer's paged kernels (where it is installed).

plait does not depend on flashinfer: the package is imported when this backend is created, and a
missing package is a clear error naming it (`pip install flashinfer-python`).

The pool is a paged KV cache with page size 1: a kv slot is a page, and a request's pages are its
`req_to_token` row (prefix + new tokens). Per step the backend builds the CSR page table (indptr on
the host, indices gathered on the device from `req_to_token`) and *plans* FlashInfer's wrappers once;
every layer then only runs the kernels.
- extend: `BatchPrefillWithPagedKVCacheWrapper`, causal (the new tokens are the last of each
  request's pages: their K/V are in the pool before attention runs).
- decode: `BatchDecodeWithPagedKVCacheWrapper`; for GQA with tensor cores (FlashInfer runs its
  prefill kernel with the query-head group as rows), for MHA the CUDA-core decode kernel.
- CUDA graphs: one graph-mode decode wrapper per captured batch size, over static indptr/indices/
  last-page buffers shared by all of them; replay re-plans (host work plus one small upload).

NOTE: backend="fa2" is pinned. "auto" picks FA3 or cuDNN on Hopper, whose JIT builds need CUTLASS and
take far longer; one FA2 prefill module per (dtype, head_dim) serves extend and GQA decode alike.

Host lengths: FlashInfer's planner splits the KV work across CTAs from host-side lengths. Extend and
eager decode batches carry them (`seq_lens_cpu`). At graph replay the caller may pass only the device
lengths: a `seq_lens_cpu` of all ones is taken as a placeholder (a real decode row holds at least its
prompt plus the new token, so 2 or more; padding rows are 0) and the lengths are read back from the
device, one sync per step. A graph runner that passes the real host lengths avoids that sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..forward_batch import ForwardBatch
from ..kvcache.kv_quant import is_fp8
from .base import AttentionBackend, AttentionLayerSpec
from .context import AttentionContext

FLASHINFER_PACKAGE = "flashinfer-python"
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # FA2 kernels FlashInfer instantiates
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)


def import_flashinfer() -> Any:
    try:
        import flashinfer  # noqa: PLC0415 - optional dependency, imported only when the backend is used
    except ImportError as e:
        raise ImportError(
            f"attention_backend='flashinfer' needs the {FLASHINFER_PACKAGE!r} package, which is not "
            f"installed ({e}). Install it with `pip install {FLASHINFER_PACKAGE}`, or use "
            "attention_backend='triton' (the default on GPU) or 'torch_native'."
        ) from e
    return flashinfer


@dataclass(frozen=True)
class FlashInferShape:
    num_heads: int  # per tensor-parallel rank
    num_kv_heads: int
    head_dim: int
    scaling: float  # softmax scale, fixed at plan time for every layer

    @property
    def is_gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the planned FlashInfer wrapper this step's layers run


@dataclass
class _GraphState:
    indptr: torch.Tensor  # (max_bs + 1,) int32, static
    last_page_len: torch.Tensor  # (max_bs,) int32, static (all ones: page size 1)
    indices: torch.Tensor  # (max kv tokens of one batch,) int32, static
    wrappers: dict = field(default_factory=dict)  # captured batch size -> graph-mode decode wrapper


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: AttentionContext, decode_tensor_cores: Optional[bool] = None):
        if ctx.kv_dtype is not None and is_fp8(ctx.kv_dtype):
            raise ValueError(
                f"the flashinfer attention backend reads a KV cache in the model's dtype, not {ctx.kv_dtype}: "
                "with an FP8 KV cache use attention_backend='triton' (or kv_cache_dtype='auto')"
            )
        self.flashinfer = import_flashinfer()
        self.device = torch.device(ctx.device)
        if self.device.type != "cuda":
            raise ValueError(
                f"the flashinfer attention backend needs a CUDA device, not {self.device.type!r} "
                "(use attention_backend='torch_native')"
            )
        self.shape = _shape_of(ctx)
        self.dtype = ctx.dtype if ctx.dtype is not None else torch.bfloat16
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"the flashinfer attention backend runs float16/bfloat16, not {self.dtype} "
                "(use dtype='bfloat16', or attention_backend='triton')"
            )
        if self.shape.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"flashinfer's kernels take head_dim in {SUPPORTED_HEAD_DIMS}, this model has "
                f"{self.shape.head_dim} (use attention_backend='triton')"
            )
        # NOTE: tensor-core decode pays off once several query heads share a KV head, and it reuses the
        # prefill module, so GQA models JIT-compile one module instead of two.
        self.decode_tensor_cores = self.shape.is_gqa if decode_tensor_cores is None else decode_tensor_cores
        self.max_total_tokens = ctx.max_total_tokens
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        fi = self.flashinfer
        self.prefill_wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.decode_wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, backend="fa2"
        )
        self._graph: Optional[_GraphState] = None
        # NOTE: a plan copies its schedule to the device from a pinned host buffer that the wrapper
        # reuses, without waiting. With overlap scheduling the next plan can come before that copy
        # has run (it queues behind the step in flight), so each plan first waits for the last one's.
        self._last_plan_done: Optional[torch.cuda.Event] = None

    # ---- per-step metadata ----
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            self._plan_decode(self.decode_wrapper, fb, fb.req_pool_indices, fb.seq_lens, list(fb.seq_lens_cpu))
            fb.attn_metadata = FlashInferMetadata(self.decode_wrapper)
            return
        if fb.extend_seq_lens_cpu is None:
            raise ValueError("an EXTEND ForwardBatch needs extend_seq_lens_cpu")
        qo_indptr = _indptr(fb.extend_seq_lens_cpu)  # (B + 1,) host
        kv_indptr, kv_indices, last_page_len = self._page_table(
            fb, fb.req_pool_indices, fb.seq_lens, list(fb.seq_lens_cpu)
        )
        s = self.shape
        self._wait_last_plan()
        self.prefill_wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            1,
            causal=True,
            sm_scale=s.scaling,
            q_data_type=self.dtype,
            kv_data_type=fb.kv_pool.dtype,
        )
        self._record_plan()
        fb.attn_metadata = FlashInferMetadata(self.prefill_wrapper)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        return self._run(q, layer, fb)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        return self._run(q, layer, fb)

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        s = self.shape
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling) != (
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.scaling,
        ):
            raise ValueError(
                f"layer {layer.layer_id} has shape {layer}, but the flashinfer backend planned "
                f"this step for {s} (one shape and softmax scale for every layer)"
            )
        q = q.reshape(q.shape[0], s.num_heads, s.head_dim)  # (T, H, D)
        if not q.is_contiguous():
            q = q.contiguous()
        out = torch.empty(q.shape[0], s.num_heads * s.head_dim, dtype=q.dtype, device=q.device)
        k_buf, v_buf = fb.kv_pool.k_buffer[layer.layer_id], fb.kv_pool.v_buffer[layer.layer_id]
        # (slots, Hkv, D) -> (pages, page_size 1, Hkv, D): FlashInfer's NHD paged layout.
        paged = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))
        fb.attn_metadata.wrapper.run(q, paged, out=out.view(q.shape))
        return out  # (T, H * D)

    # ---- page tables ----
    def _page_table(self, fb: ForwardBatch, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, lens: list[int]):
        """CSR page table of a batch: host indptr (B + 1,), device kv slots (N,), host last-page lengths.

        A row of length 0 (padding) gets one page, the dummy slot 0, so that every row is a valid
        FlashInfer request; its output is discarded.
        """
        batch = len(lens)
        kv_indptr = _indptr([max(n, 1) for n in lens])  # (B + 1,) int32 host
        total = int(kv_indptr[-1])
        eff = seq_lens.clamp(min=1)  # (B,) device, equal to the host lengths above
        row = torch.repeat_interleave(torch.arange(batch, device=self.device), eff, output_size=total)  # (N,)
        start = torch.cumsum(eff, 0) - eff  # (B,) first page of each row
        pos = torch.arange(total, device=self.device) - start[row]  # (N,) position within its request
        r2t = fb.req_to_token_pool.req_to_token
        slots = r2t[req_pool_indices[row], pos]  # (N,) int32
        slots = torch.where(seq_lens[row] > 0, slots, torch.zeros_like(slots))
        last_page_len = torch.ones(batch, dtype=torch.int32)  # page size 1: every last page is full
        return kv_indptr, slots, last_page_len

    def _plan_decode(
        self, wrapper, fb: ForwardBatch, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, lens: list[int]
    ) -> None:
        # In graph mode plan() also copies the page table into the static buffers the graphs read.
        kv_indptr, kv_indices, last_page_len = self._page_table(fb, req_pool_indices, seq_lens, lens)
        s = self.shape
        self._wait_last_plan()
        wrapper.plan(
            kv_indptr,
            kv_indices,
            last_page_len,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            1,
            sm_scale=s.scaling,
            q_data_type=self.dtype,
            kv_data_type=fb.kv_pool.dtype,
        )
        self._record_plan()

    def _wait_last_plan(self) -> None:
        if self._last_plan_done is not None:
            self._last_plan_done.synchronize()

    def _record_plan(self) -> None:
        if self._last_plan_done is None:
            self._last_plan_done = torch.cuda.Event()
        self._last_plan_done.record()

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        if self.max_total_tokens is None:
            raise ValueError(
                "CUDA graphs with the flashinfer backend need the context's max_total_tokens "
                "(to size the static page-index buffer)"
            )
        self._graph = _GraphState(
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            # Every real token of a batch is a distinct pool slot; padding rows add one page each.
            indices=torch.zeros(self.max_total_tokens + max_bs + 1, dtype=torch.int32, device=self.device),
        )

    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch) -> None:
        graph = self._require_graph_state(fb)
        bs = fb.batch_size
        if bs not in graph.wrappers:
            graph.wrappers[bs] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=graph.indptr[: bs + 1],
                paged_kv_indices_buffer=graph.indices,
                paged_kv_last_page_len_buffer=graph.last_page_len[:bs],
                backend="fa2",
            )
        self._plan_graph(graph.wrappers[bs], fb)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        graph = self._require_graph_state(fb)
        if fb.batch_size not in graph.wrappers:
            raise ValueError(f"no CUDA graph was captured for batch size {fb.batch_size}")
        self._plan_graph(graph.wrappers[fb.batch_size], fb)

    def _require_graph_state(self, fb: ForwardBatch) -> _GraphState:
        if self._graph is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) before capturing or replaying a graph")
        if not fb.forward_mode.is_decode():
            raise ValueError("CUDA graphs are only captured for DECODE batches")
        bs, n = fb.batch_size, fb.seq_lens.shape[0]
        if bs > self._graph.last_page_len.shape[0] or n > bs or fb.req_pool_indices.shape[0] != n:
            raise ValueError(
                f"graph batch of {n} requests padded to {bs} does not fit max_bs {self._graph.last_page_len.shape[0]}"
            )
        return self._graph

    def _plan_graph(self, wrapper, fb: ForwardBatch) -> None:
        bs, n = fb.batch_size, fb.seq_lens.shape[0]
        lens = list(fb.seq_lens_cpu[:n]) if fb.seq_lens_cpu is not None else []
        if len(lens) != n or all(x == 1 for x in lens):
            lens = fb.seq_lens.tolist()  # the host lengths are a placeholder: read the real ones (a sync)
        seq_lens, req = fb.seq_lens, fb.req_pool_indices
        if n < bs:  # rows n..bs are empty requests: the dummy slot, output discarded
            pad = torch.zeros(bs - n, dtype=seq_lens.dtype, device=self.device)
            seq_lens, req = torch.cat([seq_lens, pad]), torch.cat([req, pad.to(req.dtype)])
            lens = lens + [0] * (bs - n)
        self._plan_decode(wrapper, fb, req, seq_lens, lens)
        fb.attn_metadata = FlashInferMetadata(wrapper)


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)  # host
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out


def _shape_of(ctx: AttentionContext) -> FlashInferShape:
    if ctx.heads is None:
        raise ValueError("the flashinfer backend needs the attention context's head shape (it plans every step for it)")
    h = ctx.heads
    # NOTE: the models scale scores by head_dim ** -0.5 (AttentionLayerSpec.scaling); _run checks each
    # layer against it.
    return FlashInferShape(h.num_heads, h.num_kv_heads, h.head_dim, h.head_dim**-0.5)
