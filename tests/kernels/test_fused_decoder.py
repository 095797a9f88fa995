"""A whole decoder stack (Llama and Qwen3, tiny shapes) with the fused Triton ops against the same stack
on the torch reference ops: every norm with its in-place residual chain, rotary (+ KV store) and
activation in the order the model runs them. The kernels one by one: test_fused_kernels.py."""

import types

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama_model
from helpers.model_step import model_step
from plait.runtime.models.config import ModelConfig
from plait.runtime.models.layers import rms_norm_torch, set_use_triton
from plait.runtime.models.llama import LlamaForCausalLM

torch.set_num_threads(1)


class _CausalAttention:
    """Single-sequence causal attention over the step's tokens only: enough to run the decoder stack.
    With kv_stored (the fused rotary+store path) it reads this step's K/V back from the pool."""

    def forward(self, q, k, v, spec, fb, kv_stored=False):
        # q (T, H, D), k/v (T, Hkv, D) -> (T, H * D)
        if kv_stored:
            k = fb.kv_pool.k_buffer[spec.layer_id][fb.out_cache_loc]
            v = fb.kv_pool.v_buffer[spec.layer_id][fb.out_cache_loc]
        rep = spec.num_heads // spec.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=spec.scaling
        )  # (H, T, D)
        return o.transpose(0, 1).reshape(q.shape[0], -1)


def _hidden_both_ways(model, device):
    ids = torch.tensor([5, 17, 99, 3, 64, 2], device=device)
    positions = torch.tensor([0, 1, 2, 3, 4, 5], device=device)
    fb = model_step(model, _CausalAttention(), [9, 2, 4, 11, 1, 6], 16, device)
    with torch.no_grad():
        set_use_triton(model, False)
        ref = model(ids, positions, fb)
        set_use_triton(model, True)
        fused = model(ids, positions, fb)
        set_use_triton(model, None)
    return fused, ref


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_decoder_forward_fused_equals_torch(arch):
    # Every norm (with the in-place residual chain), rotary and activation of a real decoder stack.
    model = tiny_llama_model(arch, torch.float32, "cpu")
    fused, ref = _hidden_both_ways(model, "cpu")
    assert torch.allclose(fused, ref, rtol=1e-5, atol=1e-5), (fused - ref).abs().max()


def test_model_without_layers_is_the_normed_embedding():
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=50,
    )
    model = LlamaForCausalLM(cfg, max_position=64).eval()
    ids = torch.tensor([3, 7, 1])
    with torch.no_grad():
        out = model(ids, torch.arange(3), types.SimpleNamespace(capture_layers=(), lora=None))
        assert torch.allclose(out, rms_norm_torch(model.embed_tokens(ids), model.norm.weight, cfg.rms_norm_eps))


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_gpu_decoder_forward_fused_close_to_torch(arch):
    model = tiny_llama_model(arch, torch.bfloat16, "cuda")
    fused, ref = _hidden_both_ways(model, "cuda")
    assert torch.allclose(fused.float(), ref.float(), rtol=0.05, atol=0.05)
