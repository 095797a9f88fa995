"""A decoder's batch-1 decode step on the one-row path (models/llama.DecoderLayer._forward_one_row; the kernels:
runtime/kernels/gemv_fused.py, tested in tests/kernels/test_fused_gemv.py): which kernels each layer takes (half
precision opted in with `fused_decode_row`; FP8 layers by quant/fp8_rows.FP8_FUSED_ROW's parts), against the torch
path; the switches per engine. Without CUDA the kernels run in Triton's CPU interpreter at tiny sizes; the `gpu` test
runs two layers of the 8B shape.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama_model
from helpers.model_step import model_step
from plait.runtime.kernel_choices import KernelChoices, using
from plait.runtime.kernel_choices import current as current_choices
from plait.runtime.models import layers
from plait.runtime.models.layers import set_use_triton
from plait.runtime.models.llama import LlamaForCausalLM

torch.set_num_threads(1)


def kernels():
    from plait.runtime import kernels as k  # imported in the test, after conftest chose the interpreter

    return k


@pytest.fixture
def fused_decode_row():
    """The opt-in one-row path on, for the test (as a runner with enable_fused_decode_row runs forwards)."""
    with using(KernelChoices(fused_decode_row=True)):
        yield


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


class _OneTokenAttention:
    """Attention of a single token at position 0 over itself: the output is its own v (per query head)."""

    def forward(self, q, k, v, spec, fb, kv_stored=False):
        # q (1, H, D), v (1, Hkv, D) -> (1, H * D)
        if kv_stored:
            v = fb.kv_pool.v_buffer[spec.layer_id][fb.out_cache_loc]
        return v.repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=1).reshape(1, -1)


def _one_token_batch(model: LlamaForCausalLM, device="cpu"):
    fb = model_step(model, _OneTokenAttention(), [3], 8, device)
    return torch.tensor([17], device=device), torch.tensor([0], device=device), fb


def _counting(monkeypatch, names):
    """Wrap the real kernels so the test can see which ones the model called."""
    calls = {name: 0 for name in names}
    k_ = kernels()
    for name in names:
        real = getattr(k_, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(k_, name, wrapper)
    return calls


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("fuse_gate_up", [True, False])
def test_decoder_one_row_path_matches_torch(arch, fuse_gate_up, monkeypatch, fused_decode_row):
    # float16: the interpreter rounds it like torch, so the fused path must agree closely with the torch
    # reference path (which the CPU uses, and which tests/models/test_correctness_vs_hf.py pins to transformers).
    monkeypatch.setattr(layers, "FUSE_NORM_INTO_GATE_UP", fuse_gate_up)
    model = tiny_llama_model(arch)
    cfg = model.config
    ids, positions, fb = _one_token_batch(model)
    calls = _counting(monkeypatch, ["rmsnorm_gemv", "silu_mul_gemv", "gemv_row"])
    with torch.no_grad():
        set_use_triton(model, False)
        ref_hidden = model(ids, positions, fb)
        ref_logits = model.compute_logits(ref_hidden)
        assert sum(calls.values()) == 0 and torch.equal(model.forward_logits(ids, positions, fb), ref_logits)
        set_use_triton(model, True)
        hidden = model(ids, positions, fb)
        logits = model.forward_logits(ids, positions, fb)
    layers_run = 2 * cfg.num_hidden_layers  # forward + forward_logits
    assert calls == {
        "rmsnorm_gemv": layers_run * (2 if fuse_gate_up else 1) + 1,
        "silu_mul_gemv": layers_run,
        "gemv_row": layers_run,
    }
    assert rel_err(hidden, ref_hidden) < 1e-3  # float32 sums in another order, float16 results
    assert rel_err(logits, ref_logits) < 1e-3  # the fused LM head skips the float16 rounding of the logits
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


@pytest.mark.parametrize(
    "arch,fused_row", [("LlamaForCausalLM", 15), ("Qwen2ForCausalLM", 15), ("LlamaForCausalLM", 1)]
)
def test_fp8_decoder_one_row_path_folds_norms_and_activation(arch, fused_row, monkeypatch):
    # An FP8 model's batch-1 step with FP8_FUSED_ROW on (fused_decode_row off, as ServerArgs leaves it): each FP8
    # layer whose bit is set takes its one-row kernel with the op before it inside, gate-up's norm too, the others
    # their unfused kernels; the half-precision LM head stays apart. Against the torch path over the same weights
    # dequantized (float16: the interpreter rounds it like torch).
    import copy

    from plait.runtime.quant import fp8_rows
    from plait.runtime.quant.apply import quantize_fp8
    from plait.runtime.quant.fp8 import Fp8Linear

    model = tiny_llama_model(arch)
    quantize_fp8(model, torch.float16)
    reference = copy.deepcopy(model)
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            parent, _, attr = name.rpartition(".")
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = module.dequantized()
            if module.bias is not None:
                linear.bias.data = module.bias.data.clone()
            setattr(reference.get_submodule(parent), attr, linear)
    ids, positions, fb = _one_token_batch(model)
    calls = _counting(monkeypatch, ["rmsnorm_gemv", "silu_mul_gemv", "gemv_row", "fused_add_rmsnorm", "silu_and_mul"])
    with torch.no_grad():
        set_use_triton(reference, False)
        ref_logits = reference.forward_logits(ids, positions, fb)
        set_use_triton(model, True)
        down = model.layers[0].mlp.down_proj.weight
        monkeypatch.setattr(fp8_rows, "FP8_FUSED_ROW", 0)
        assert not layers.fuses_decode_row(torch.ones(1, 64, dtype=torch.float16), down, True)
        monkeypatch.setattr(fp8_rows, "FP8_FUSED_ROW", fused_row)
        assert layers.fuses_decode_row(torch.ones(1, 64, dtype=torch.float16), down, True)
        logits = model.forward_logits(ids, positions, fb)
    n = model.config.num_hidden_layers
    if fused_row == 15:  # (the final norm runs apart, before the float16 head)
        want = {"rmsnorm_gemv": 2 * n, "silu_mul_gemv": n, "gemv_row": n, "fused_add_rmsnorm": 1, "silu_and_mul": 0}
    else:  # QKV's norm alone inside its matmul: gate-up's (with the residual) and SiLU-and-mul apart
        want = {"rmsnorm_gemv": n, "silu_mul_gemv": 0, "gemv_row": 0, "fused_add_rmsnorm": n + 1, "silu_and_mul": n}
    assert calls == want
    if fused_row == 15:
        assert rel_err(logits, ref_logits) < 1e-2  # float32 sums in another order, float16 results
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    else:  # (the unfused FP8 layers of CPU tensors quantize their rows too, as _scaled_mm's path does)
        assert rel_err(logits, ref_logits) < 0.1


def test_decoder_takes_the_unfused_path_for_several_rows_and_float32(monkeypatch, fused_decode_row):
    calls = _counting(monkeypatch, ["rmsnorm_gemv", "silu_mul_gemv", "gemv_row"])
    x = torch.randn(2, 8, dtype=torch.float16)
    w16 = torch.randn(4, 8, dtype=torch.float16)
    assert not layers.fuses_decode_row(x, w16, True)  # two rows: a prefill or a batch
    assert not layers.fuses_decode_row(x[:1].float(), w16.float(), True)  # float32 weights
    assert not layers.fuses_decode_row(x[:1], w16, None)  # CPU tensors, device choice: torch
    assert layers.fuses_decode_row(x[:1], w16, True)
    with using(KernelChoices(fused_decode_row=False)):
        assert not layers.fuses_decode_row(x[:1], w16, True)  # switched off: never
    assert sum(calls.values()) == 0


def test_default_decode_step_is_the_unfused_path(monkeypatch):
    # The fused one-row path measured slower on an H200, so it is opt-in: off unless an engine's settings
    # ask for it (enable_fused_decode_row), and only for that engine's runner.
    from plait.runtime.server_args import ServerArgs

    assert KernelChoices().fused_decode_row is False and ServerArgs().kernel_choices() == KernelChoices()
    assert ServerArgs(enable_fused_decode_row=True).kernel_choices().fused_decode_row is True
    assert current_choices() == KernelChoices()  # what a forward outside any runner reads
    assert layers.FUSE_NORM_INTO_GATE_UP is False  # on the fused path, gate_up's norm apart measured faster
    model = tiny_llama_model("LlamaForCausalLM")
    ids, positions, fb = _one_token_batch(model)
    calls = _counting(monkeypatch, ["rmsnorm_gemv", "silu_mul_gemv", "gemv_row", "fused_add_rmsnorm"])
    with torch.no_grad():
        set_use_triton(model, False)
        ref_logits = model.compute_logits(model(ids, positions, fb))
        set_use_triton(model, True)  # the Triton kernels, as on CUDA, at one row
        hidden = model(ids, positions, fb)
        logits = model.forward_logits(ids, positions, fb)
    assert calls["rmsnorm_gemv"] == calls["silu_mul_gemv"] == calls["gemv_row"] == 0
    # 2 norms a layer (the first layer's first has no residual) + the final norm, in each of two forwards
    assert calls["fused_add_rmsnorm"] == 2 * (2 * model.config.num_hidden_layers - 1 + 1)
    # forward_logits is the final norm, then compute_logits: the same kernels as forward + compute_logits
    assert torch.equal(logits, model.compute_logits(hidden))
    assert rel_err(logits, ref_logits) < 1e-3 and torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_two_runners_in_one_process_keep_their_own_kernel_choices(random_models):
    # The switches are per engine (ServerArgs), not read once at import: each runner runs its forwards
    # inside its own choices, and nothing leaks out of them.
    from plait.runtime.executor.model_runner import ModelRunner
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.request import Req
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.batch import ScheduleBatch
    from plait.runtime.server_args import ServerArgs

    path = random_models["llama"]
    seen = {}
    for name, settings in (("plain", {}), ("tuned", {"enable_fused_decode_row": True, "disable_decode_gemm": True})):
        mr = ModelRunner(ServerArgs(model_path=path, device="cpu", max_total_tokens=64, **settings), path)
        forward = mr.model.forward

        def spy(*a, name=name, forward=forward, **k):
            seen[name] = current_choices()
            return forward(*a, **k)

        mr.model.forward = spy
        r = Req("r", [3, 4, 5], SamplingParams(max_new_tokens=1, temperature=0))
        r.req_pool_idx = mr.req_to_token_pool.alloc()
        mr.run(ScheduleBatch(ForwardMode.EXTEND, [r], [0], [3], mr.allocator.alloc(3)).to_step())
    assert seen["plain"] == KernelChoices()
    assert seen["tuned"] == KernelChoices(decode_gemm=False, fused_decode_row=True)
    assert current_choices() == KernelChoices()


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
def test_gpu_decoder_one_row_path_8b_layer_shapes(fused_decode_row):
    # Two layers of the 8B shape in bf16: the fused one-row path (opted in) against the torch path on the GPU.
    model = tiny_llama_model(
        "LlamaForCausalLM",
        torch.bfloat16,
        "cuda",
        scale=0.02,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    )
    ids, positions, fb = _one_token_batch(model, "cuda")
    with torch.no_grad():
        set_use_triton(model, False)
        ref = model.compute_logits(model(ids, positions, fb))
        set_use_triton(model, None)  # CUDA tensors: the Triton kernels, fused at one row
        hidden = model(ids, positions, fb)
        logits = model.forward_logits(ids, positions, fb)
    assert rel_err(logits, ref) < 1e-2
    assert rel_err(model.compute_logits(hidden), logits) < 1e-2
