"""FP8 checkpoints as Hugging Face publishes them (issue 38), written on the fly from a random float model:
`quant_method: "fp8"` with per-tensor weight scales and static input scales, and compressed-tensors
`float-quantized` with per-channel scales. Loaded as they are: the FP8 codes bit for bit, per-tensor scales
broadcast to their rows of the fused QKV / gate-up, `quantization` implied; the errors for what does not fit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from plait.runtime import Engine
from plait.runtime.executor.loader import load_model, load_model_config
from plait.runtime.executor.model_runner import resolve_quantization
from plait.runtime.models.config import ModelConfig
from plait.runtime.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear, quantize_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [200, 17, 3, 99, 42], [1 + (i * 37) % 250 for i in range(16)]]


def _fp8_folder(float_folder: str, out: str, per_channel: bool, drop: str = "") -> dict:
    """`float_folder`'s model as an FP8 checkpoint in `out` (compressed-tensors per channel, or "fp8" per
    tensor with static input scales: 0.01 x the part's index, so a fused layer's largest is known); the
    tensor named `drop` left out. Returns the scales written, by tensor name."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out)
    tensors = load_file(os.path.join(float_folder, "model.safetensors"))
    written, scales = {}, {}
    for name, t in tensors.items():
        if not name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            written[name] = t
            continue
        base = name.removesuffix(".weight")
        if per_channel:
            codes, scale = quantize_per_channel(t)
            scale = scale[:, None]  # (N, 1), as compressed-tensors saves it
        else:
            scale = t.float().abs().amax() / FP8_MAX  # () per tensor
            codes = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            written[f"{base}.input_scale"] = torch.tensor([0.01 * (1 + PROJECTIONS.index(base.rsplit(".", 1)[1]))])
        written[name], written[f"{base}.weight_scale"] = codes, scale
        scales[f"{base}.weight_scale"] = scale
    written.pop(drop, None)
    save_file(written, os.path.join(out, "model.safetensors"))
    with open(os.path.join(float_folder, "config.json")) as f:
        cfg = json.load(f)
    if per_channel:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
    else:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "ignored_layers": ["lm_head"],
        }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return scales


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    from conftest import make_random_model

    return make_random_model(str(tmp_path_factory.mktemp("fp8ckpt") / "llama"), "llama")


def _load(folder: str):
    cfg = load_model_config(folder, "auto")
    return load_model(folder, cfg, "auto", torch.float32, "cpu", 64)


def _top1(folder: str, **settings):
    with Engine(model_path=folder, **settings) as eng:
        outs = eng.generate(
            input_ids=PROMPTS,
            sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )
        quantization = eng.get_server_info()["quantization"]
    tops = [[(t[0][1], round(t[0][0], 4)) for t in o["meta_info"]["input_top_logprobs"] if t] for o in outs]
    return tops, [o["output_ids"] for o in outs], quantization


def test_per_channel_checkpoint_runs_as_the_float_model_quantized_at_load(float_llama, tmp_path):
    """The same codes and scales either way: the checkpoint's FP8 model is the load-time one, exactly."""
    folder = str(tmp_path / "ct")
    _fp8_folder(float_llama, folder, per_channel=True)
    model = _load(folder)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8_DTYPE and qkv.input_scale is None
    assert type(model.lm_head) is torch.nn.Linear  # ignored: bf16 / float as saved
    tops, greedy, quantization = _top1(folder)  # quantization implied by the config
    assert quantization == "fp8"
    assert (tops, greedy) == _top1(float_llama, quantization="fp8")[:2]


def test_per_tensor_scales_are_broadcast_to_their_rows_of_the_fused_layers(float_llama, tmp_path):
    folder = str(tmp_path / "fp8")
    scales = _fp8_folder(float_llama, folder, per_channel=False)
    model = _load(folder)
    cfg = model.config
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    expected_qkv = torch.cat(
        [
            scales[f"model.layers.1.self_attn.{p}.weight_scale"].expand(n)
            for p, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        ]
    )
    assert torch.equal(attn.qkv_proj.weight_scale, expected_qkv)
    expected_gate_up = torch.cat(
        [scales[f"model.layers.1.mlp.{p}.weight_scale"].expand(inter) for p in ("gate_proj", "up_proj")]
    )
    assert torch.equal(mlp.gate_up_proj.weight_scale, expected_gate_up)
    assert torch.equal(
        attn.o_proj.weight_scale, scales["model.layers.1.self_attn.o_proj.weight_scale"].expand(cfg.hidden_size)
    )
    # Static activation scales: a fused layer's parts share one input, so it takes their largest.
    assert attn.qkv_proj.input_scale.item() == pytest.approx(
        0.03
    ) and mlp.gate_up_proj.input_scale.item() == pytest.approx(0.06)
    assert attn.o_proj.input_scale.item() == pytest.approx(0.04)
    # The codes as saved, bit for bit (k's rows of the fused QKV).
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as st:
        k_codes = st.get_tensor("model.layers.1.self_attn.k_proj.weight")
    assert torch.equal(attn.qkv_proj.weight[q : q + kv].view(torch.uint8), k_codes.view(torch.uint8))
    _, greedy, quantization = _top1(folder, quantization="fp8")  # fp8 asked for: the same as implied
    assert quantization == "fp8" and all(len(g) == 4 for g in greedy)


def test_a_missing_scale_is_an_error_naming_the_tensor(float_llama, tmp_path):
    folder = str(tmp_path / "missing")
    _fp8_folder(float_llama, folder, per_channel=False, drop="model.layers.0.self_attn.k_proj.weight_scale")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight_scale.*says FP8"):
        _load(folder)


def test_fp8_checkpoint_errors(float_llama, tmp_path):
    folder = str(tmp_path / "ct")
    _fp8_folder(float_llama, folder, per_channel=True)
    cfg = load_model_config(folder, "auto")
    assert resolve_quantization(None, cfg) == resolve_quantization("fp8", cfg) == "fp8"
    with pytest.raises(ValueError, match="quantization=int8 with an FP8 checkpoint"):
        resolve_quantization("int8", cfg)
    # A config that keeps a layer in float while its weights are FP8: named, never cast silently.
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["quantization_config"]["ignore"] = ["lm_head", "re:.*down_proj"]
    with open(path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=r"down_proj.weight' is torch.float8_e4m3fn where plait expects torch.float32"):
        _load(folder)


@pytest.mark.parametrize(
    "quant, message",
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
        ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'pack-quantized' is not supported"),
        ({"quant_method": "gptq"}, r"quantized checkpoints \(gptq\) are not supported"),
    ],
)
def test_fp8_configs_plait_cannot_run_are_refused(quant, message):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "quantization_config": quant,
    }
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(cfg)
