"""Model folders plait cannot run fail with an error naming the problem and what works: unsupported
architectures and settings, unreadable configs, broken or missing weights, paths that are not folders,
broken tokenizers; the Engine says so before a scheduler starts, or from its start-up."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from helpers.model_folders import SHAPE, edit_json, make_folder
from plait.runtime import Engine
from plait.runtime.executor.loader import load_model, load_model_config, load_tokenizer


def write_config(folder, **config) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


SUPPORTED = (
    r".*plait supports \['LlamaForCausalLM', 'LlavaForConditionalGeneration', 'MistralForCausalLM', "
    r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM'\]"
)
BAD_CONFIGS = {
    "gpt2": (
        dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=64),
        r"\['GPT2LMHeadModel'\]" + SUPPORTED,
    ),
    "gemma": (dict(architectures=["GemmaForCausalLM"], **SHAPE), r"\['GemmaForCausalLM'\]" + SUPPORTED),
    "mixtral": (
        dict(architectures=["MixtralForCausalLM"], num_local_experts=8, **SHAPE),
        r"\['MixtralForCausalLM'\].*mixture-of-experts" + SUPPORTED,
    ),
    "qwen2-vl": (
        dict(architectures=["Qwen2VLForConditionalGeneration"], text_config={}, vision_config={}),
        r"\['Qwen2VLForConditionalGeneration'\].*multimodal" + SUPPORTED,
    ),
    "llava-siglip": (
        dict(
            architectures=["LlavaForConditionalGeneration"],
            text_config=dict(model_type="llama", **SHAPE),
            vision_config=dict(model_type="siglip_vision_model"),
        ),
        r"vision tower 'siglip_vision_model' is not supported; plait runs CLIP towers",
    ),
    "llava-qwen2": (
        dict(architectures=["LlavaForConditionalGeneration"], text_config=dict(model_type="qwen2", **SHAPE)),
        r"a LlavaForConditionalGeneration over a 'qwen2' decoder is not supported",
    ),
    "missing-key": (
        dict(architectures=["LlamaForCausalLM"], hidden_size=64),
        r"config.json lacks \['intermediate_size'",
    ),
    "gptq": (
        dict(architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "gptq"}, **SHAPE),
        r"quantized checkpoints \(gptq\) are not supported",
    ),
    "yarn": (
        dict(architectures=["Qwen2ForCausalLM"], rope_scaling={"type": "yarn", "factor": 4.0}, **SHAPE),
        r"rope scaling 'yarn' is not supported; plait supports \['default', 'linear', 'llama3'\]",
    ),
    "gelu": (
        dict(architectures=["LlamaForCausalLM"], hidden_act="gelu", **SHAPE),
        r"hidden_act 'gelu' is not supported",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_unsupported_config_is_named(tmp_path, name):
    config, message = BAD_CONFIGS[name]
    with pytest.raises(ValueError, match=message):
        load_model_config(write_config(tmp_path / name, **config), "auto")


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ValueError, match=r"no config.json in model folder .*holds config.json, the weights"):
        load_model_config(str(tmp_path), "auto")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_model_config(str(tmp_path), "auto")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):  # not blamed on the tokenizer
        load_tokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("good") / "llama", "llama", shard="100KB")


def broken_copy(good_folder, tmp_path, change) -> str:
    path = str(tmp_path / "broken")
    shutil.copytree(good_folder, path)
    change(path)
    return path


def _weights(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _drop_weights(path):
    for f in _weights(path):
        os.remove(os.path.join(path, f))
    os.remove(os.path.join(path, "model.safetensors.index.json"))


def _to_pickle(path):
    from safetensors.torch import load_file

    state = {k: v for f in _weights(path) for k, v in load_file(os.path.join(path, f)).items()}
    _drop_weights(path)
    torch.save(state, os.path.join(path, "pytorch_model.bin"))


def _truncate_last_shard(path):
    file = os.path.join(path, _weights(path)[-1])
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])


BROKEN_FOLDERS = {
    "no-weights": (_drop_weights, r"no weights \(\*.safetensors\) in model folder .*load_format='dummy'"),
    "pytorch-bin-only": (_to_pickle, r"only \['pytorch_model.bin'\]: plait reads safetensors.*save_pretrained"),
    "gguf-only": (
        lambda p: (_drop_weights(p), open(os.path.join(p, "m.gguf"), "wb").close()),
        r"only \['m.gguf'\]: plait does not read GGUF.*gguf_file=",
    ),
    "truncated-shard": (
        _truncate_last_shard,
        r"model-0000\d-of-0000\d.safetensors is not a readable safetensors file"
        r".*truncated or corrupt",
    ),
    "missing-shard": (
        lambda p: os.remove(os.path.join(p, _weights(p)[1])),
        r"1 of the \d weight shards that .*index.json lists are not in the folder: "
        r"\['model-00002-of-0000\d.safetensors'\]",
    ),
    "config-of-another-size": (
        lambda p: edit_json(os.path.join(p, "config.json"), lambda c: c.update(intermediate_size=256)),
        r"'layers.0.mlp.gate_proj.weight' has shape \(128, 64\) where config.json implies "
        r"\(256, 64\)",
    ),
    "untied-without-lm-head": (
        lambda p: edit_json(os.path.join(p, "config.json"), lambda c: c.update(tie_word_embeddings=False)),
        None,
    ),
}


@pytest.mark.parametrize("name", list(BROKEN_FOLDERS))
def test_broken_weights_are_named(good_folder, tmp_path, name):
    change, message = BROKEN_FOLDERS[name]
    path = broken_copy(good_folder, tmp_path, change)
    if message is None:  # the good folder is tied: only an untied config misses lm_head
        shutil.rmtree(path)
        path = make_folder(tmp_path / "tied", "llama", tie_word_embeddings=True)
        edit_json(os.path.join(path, "config.json"), lambda c: c.update(tie_word_embeddings=False))
        message = r"missing 1 weight\(s\).*\['lm_head.weight'\] \(config.json says tie_word_embeddings=false"
    cfg = load_model_config(path, "auto")
    with pytest.raises(ValueError, match=message):
        load_model(path, cfg, "auto", torch.float32, "cpu", max_position=64)


def test_paths_that_are_not_folders(tmp_path):
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"is not a folder \(a GGUF file: plait does not read GGUF; convert it"):
        load_model_config(str(gguf), "auto")
    with pytest.raises(ValueError, match=r"is not a folder \(nothing exists at that path\).*no hub downloads"):
        load_model_config(str(tmp_path / "missing"), "auto")
    with pytest.raises(ValueError, match=r"is not a folder \(nothing exists at that path\)"):
        load_tokenizer(str(tmp_path / "missing"))  # a mistyped tokenizer_path is not silently no tokenizer


def test_tokenizer_missing_or_broken(good_folder, tmp_path, caplog):
    assert load_tokenizer(good_folder) is None  # ids only, and said so
    assert "no tokenizer in" in caplog.text and "input_ids" in caplog.text
    path = broken_copy(good_folder, tmp_path, lambda p: open(os.path.join(p, "tokenizer.json"), "w").write("{}"))
    with pytest.raises(ValueError, match=r"the tokenizer in .* failed to load"):
        load_tokenizer(path)


def test_engine_reports_an_unsupported_folder(tmp_path):
    path = write_config(tmp_path / "gemma", architectures=["GemmaForCausalLM"], **SHAPE)
    with pytest.raises(
        RuntimeError,
        match=r"the scheduler failed to start: ValueError: unsupported model "
        r"architecture \['GemmaForCausalLM'\]" + SUPPORTED,
    ):
        Engine(model_path=path, num_threads=1)


def test_engine_refuses_a_path_that_is_not_a_folder_before_starting_a_scheduler(tmp_path, capfd):
    # A hub name: the error comes from the caller's process at once, with no scheduler traceback before it.
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"'meta-llama/Llama-3.1-8B-Instruct' is not a folder \(nothing exists"):
        Engine(model_path="meta-llama/Llama-3.1-8B-Instruct", num_threads=1)
    assert time.monotonic() - started < 5
    assert "Traceback" not in capfd.readouterr().err
