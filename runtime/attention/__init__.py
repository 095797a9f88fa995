"""Attention backends behind one interface (see base.py)."""


def create_attention_backend(name: str, model_runner) -> "AttentionBackend":  # noqa: F821
    if name == "torch_native":
        from .torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend(model_runner)
    if name == "triton":
        from .triton_backend import TritonAttnBackend

        return TritonAttnBackend(model_runner)
    if name == "flashinfer":
        from .flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(model_runner)
    raise ValueError(f"unknown attention backend {name!r}")
