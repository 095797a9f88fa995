"""Attention backends behind one interface (see base.py), each built from an `AttentionContext`."""

from .context import AttentionContext, AttentionHeads


def create_attention_backend(name: str, ctx: AttentionContext) -> "AttentionBackend":  # noqa: F821
    if name == "torch_native":
        from .torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend(ctx)
    if name == "triton":
        from .triton_backend import TritonAttnBackend

        return TritonAttnBackend(ctx)
    if name == "flashinfer":
        from .flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(ctx)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionContext", "AttentionHeads", "create_attention_backend"]
