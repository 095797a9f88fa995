"""A user's own Hugging Face model folders: the variants save_pretrained writes load and match
transformers token for token; EOS lists and chat templates from the folder are the ones used; context
limits, dtype and paths as the Engine and server read them. Folders plait cannot run:
test_model_folder_errors.py. The folders are built by model_folders.py.
"""

from __future__ import annotations

import json
import os

import pytest
import requests
import torch
from conftest import hf_greedy, http_server_in_thread
from helpers.model_folders import EOS, GREEDY, SHAPE, TEMPLATE, build_tokenizer, edit_json, make_folder, random_prompts
from plait.runtime import Engine
from plait.runtime.executor.loader import load_model, load_model_config, load_tokenizer
from plait.runtime.models.config import ModelConfig
from transformers import AutoModelForCausalLM

# ------------------------------------------------------------------ folders that run
VARIANTS = {
    # name: (model_type, save dtype, max_shard_size, config overrides, keys dropped from config.json)
    "llama-tied-fp32": ("llama", torch.float32, None, dict(tie_word_embeddings=True), ()),
    "llama3-rope-bf16-sharded": (
        "llama",
        torch.bfloat16,
        "100KB",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        (),
    ),
    "llama-attention-bias": ("llama", torch.float32, None, dict(attention_bias=True), ()),
    "qwen2-fp16-tied": ("qwen2", torch.float16, None, dict(tie_word_embeddings=True), ()),
    "qwen3-sharded": ("qwen3", torch.float32, "150KB", dict(head_dim=16, tie_word_embeddings=False), ()),
    "mistral-no-architectures": ("mistral", torch.float32, None, dict(sliding_window=4096), ("architectures",)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_folder_matches_transformers(tmp_path, variant):
    model_type, dtype, shard, config, drop = VARIANTS[variant]
    path = make_folder(tmp_path / variant, model_type, dtype, shard, drop_keys=drop, **config)
    if shard:
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    hf = AutoModelForCausalLM.from_pretrained(
        make_folder(tmp_path / "ref", model_type, dtype, shard, **config), dtype=torch.float32
    ).eval()
    prompts = random_prompts()
    expected = [hf_greedy(hf, p, GREEDY["max_new_tokens"], [EOS]) for p in prompts]
    # Alternate the prefix cache across variants: the second pass then runs on cached prefixes or not.
    radix_off = list(VARIANTS).index(variant) % 2 == 1
    with Engine(model_path=path, dtype="float32", disable_radix_cache=radix_off, num_threads=1) as eng:
        batched = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        alone = [eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
        assert eng.check_integrity()
    assert batched == expected
    assert alone == expected


def test_stray_consolidated_file_next_to_an_index_is_not_read(tmp_path):
    # Mistral's releases ship consolidated.safetensors (their own names) beside the HF shards.
    path = make_folder(tmp_path / "m", "mistral", shard="100KB")
    with open(os.path.join(path, "consolidated.safetensors"), "wb") as f:
        f.write(b"not read")
    cfg = load_model_config(path, "auto")
    load_model(path, cfg, "auto", torch.float32, "cpu", max_position=64)


# ------------------------------------------------------------------ EOS lists and chat templates
@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A Llama folder with the BPE tokenizer, its chat template in tokenizer_config.json only (the older
    layout), and EOS ids in both config.json and a generation_config.json list, chosen from the model's
    own greedy outputs so each of three prompts stops at a different one."""
    root = tmp_path_factory.mktemp("chat")
    tok = build_tokenizer()
    path = make_folder(root / "llama", "llama", tokenizer=tok)
    if os.path.exists(os.path.join(path, "chat_template.jinja")):
        os.remove(os.path.join(path, "chat_template.jinja"))
    edit_json(os.path.join(path, "tokenizer_config.json"), lambda c: c.update(chat_template=TEMPLATE))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts()
    free = [hf_greedy(hf, p, 12, []) for p in prompts]
    stops = [free[0][3], free[1][5], free[2][7]]
    for i, (out, _stop) in enumerate(zip(free, stops)):
        # each prompt must reach its own stop id before any other: the test's premise
        first = [out.index(s) if s in out else 99 for s in stops + [EOS]]
        assert min(first) == first[i], (free, stops)
    edit_json(os.path.join(path, "config.json"), lambda c: c.update(eos_token_id=[EOS, stops[2]]))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": [stops[0], stops[1]]}, f)
    return path, prompts, stops, hf


@pytest.fixture(scope="module")
def chat_engine(chat_folder):
    with Engine(model_path=chat_folder[0], num_threads=1, context_length=64) as eng:
        yield eng


def test_generation_stops_at_every_eos_id_of_both_files(chat_folder, chat_engine):
    _, prompts, stops, hf = chat_folder
    outs = chat_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    eos_ids = [EOS, *stops]
    for out, prompt, stop in zip(outs, prompts, stops):
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == hf_greedy(hf, prompt, GREEDY["max_new_tokens"], eos_ids)


def test_chat_template_from_tokenizer_config_is_applied(chat_folder, chat_engine):
    import plait as sgl
    from plait.backend.engine_backend import EngineBackend

    tok = load_tokenizer(chat_folder[0])
    assert tok.chat_template == TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    expected = chat_engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 6})
    with http_server_in_thread(chat_engine) as url:
        name = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        res = requests.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": name, "messages": messages, "max_tokens": 6, "temperature": 0},
        ).json()
    assert res["usage"]["prompt_tokens"] == len(ids)
    assert res["choices"][0]["message"]["content"] == expected["text"]

    @sgl.function
    def chat(s):
        s += sgl.system("be brief")
        s += sgl.user("hello there")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4, temperature=0))

    text = chat.run(backend=EngineBackend(chat_engine)).text()
    assert text.startswith(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_jinja_file_is_loaded(tmp_path):
    folder = tmp_path / "tok"
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    assert os.path.isfile(folder / "chat_template.jinja")  # transformers' current layout
    assert load_tokenizer(str(folder)).chat_template == TEMPLATE


def test_prompt_longer_than_the_context_is_a_clear_error(chat_engine):
    with pytest.raises(ValueError, match="prompt is too long: 70 tokens, the context length is 64"):
        chat_engine.generate(input_ids=list(range(3, 73)), sampling_params=GREEDY)
    with pytest.raises(ValueError, match="more than the context length 64"):
        chat_engine.generate(input_ids=list(range(3, 60)), sampling_params=GREEDY)


# ------------------------------------------------------------------ context limits
def test_context_length_above_the_model_limit_is_an_error():
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], **SHAPE))
    assert cfg.resolve_context_length(None) == 256
    assert cfg.resolve_context_length(100) == 100
    with pytest.raises(
        ValueError,
        match=r"context_length 10000 is above this model's limit of 256 tokens "
        r"\(max_position_embeddings in config.json\)",
    ):
        cfg.resolve_context_length(10000)


def test_sliding_window_shorter_than_the_context_limits_it():
    # Mistral-7B-v0.1: a 4096 window, 32768 positions. plait runs full attention: exact within the window.
    cfg = ModelConfig.from_dict(
        dict(architectures=["MistralForCausalLM"], **SHAPE | dict(max_position_embeddings=32768, sliding_window=4096))
    )
    assert cfg.max_position_embeddings == 4096
    with pytest.raises(ValueError, match="sliding window"):
        cfg.resolve_context_length(8192)
    qwen = dict(
        architectures=["Qwen2ForCausalLM"],
        **SHAPE | dict(max_position_embeddings=32768, sliding_window=4096, max_window_layers=28),
    )
    assert ModelConfig.from_dict(qwen).max_position_embeddings == 32768  # use_sliding_window off
    assert (
        ModelConfig.from_dict(qwen | dict(use_sliding_window=True, max_window_layers=1)).max_position_embeddings == 4096
    )


# ------------------------------------------------------------------ what the Engine and server make of a folder
def test_engine_refuses_a_context_length_above_the_model_limit(chat_folder):
    with pytest.raises(RuntimeError, match=r"context_length 10000 is above this model's limit of 256 tokens"):
        Engine(model_path=chat_folder[0], num_threads=1, context_length=10000)


def test_the_tokenizer_eos_ends_generation_when_the_configs_do_not_list_it(tmp_path):
    # config.json names another id as EOS; the tokenizer's own <|im_end|> (2) must still end a request,
    # as in SGLang. The bias forces 2 at every step: without the stop the output is 2, 2, 2, ...
    path = make_folder(tmp_path / "llama", "llama", tokenizer=build_tokenizer(), eos_token_id=5)
    with Engine(model_path=path, num_threads=1, context_length=64) as eng:
        out = eng.generate(input_ids=[3, 4, 7], sampling_params={**GREEDY, "logit_bias": {str(EOS): 100.0}})
    assert out["output_ids"] == [EOS]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


def test_auto_dtype_keeps_a_float16_checkpoint_in_float16_on_the_gpu():
    from plait.runtime.server_args import ServerArgs

    assert (
        ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], torch_dtype="float16", **SHAPE)).checkpoint_dtype
        == "float16"
    )
    assert (
        ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], dtype="bfloat16", **SHAPE)).checkpoint_dtype
        == "bfloat16"
    )
    gpu, cpu = ServerArgs(device="cuda"), ServerArgs(device="cpu")
    assert gpu.resolved_dtype("float16") == torch.float16
    assert gpu.resolved_dtype("bfloat16") == gpu.resolved_dtype("float32") == gpu.resolved_dtype(None) == torch.bfloat16
    assert cpu.resolved_dtype("float16") == torch.float32
    assert ServerArgs(device="cuda", dtype="float32").resolved_dtype("float16") == torch.float32


def test_a_home_relative_model_path_is_expanded():
    from plait.runtime.server_args import ServerArgs

    sa = ServerArgs(model_path="~/models/llama", tokenizer_path="~/tok")
    assert sa.model_path == os.path.expanduser("~/models/llama") and not sa.model_path.startswith("~")
    assert sa.tokenizer_path == os.path.expanduser("~/tok")


def test_requests_may_name_the_model_by_its_folder_name(chat_folder, chat_engine):
    folder_name = os.path.basename(chat_folder[0])
    with http_server_in_thread(chat_engine) as url:
        ok = requests.post(
            url + "/v1/completions",
            timeout=60,
            json={"model": folder_name, "prompt": "hello", "max_tokens": 2, "temperature": 0},
        )
        missing = requests.post(
            url + "/v1/completions",
            timeout=60,
            json={"model": "not-" + folder_name, "prompt": "hello", "max_tokens": 2},
        )
    assert ok.status_code == 200, ok.text
    assert missing.status_code == 404 and "does not exist" in missing.text


def test_num_threads_must_be_a_positive_int():
    from plait.runtime.server_args import ServerArgs

    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(ValueError, match="num_threads must be a positive int"):
            ServerArgs(num_threads=bad)
    assert ServerArgs(num_threads=2).num_threads == 2 and ServerArgs().num_threads is None
