"""Tiny Hugging Face model folders for the model-folder tests: random models (hidden 64, 2 layers) written by
transformers' save_pretrained, with a small byte-level BPE tokenizer trained here by the `tokenizers` library."""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 320
EOS = 2  # "<|im_end|>" in the tokenizer below
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=EOS,
    # NOTE: a large init makes the logits peaked: no greedy near-ties for float noise to flip
    initializer_range=0.3,
)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = {"temperature": 0, "max_new_tokens": 16}


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello there, how are you today?",
        "system user assistant: be brief and kind",
    ] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>")


def make_folder(
    folder, model_type: str, dtype=torch.float32, shard=None, tokenizer=None, drop_keys=(), **config
) -> str:
    """save_pretrained of a random `model_type` model (and the tokenizer, when given) into `folder`."""
    cfg = AutoConfig.for_model(model_type, **(SHAPE | config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if drop_keys:
        edit_json(os.path.join(folder, "config.json"), lambda c: [c.pop(k) for k in drop_keys])
    return str(folder)


def edit_json(file: str, change) -> None:
    with open(file) as f:
        data = json.load(f)
    change(data)
    with open(file, "w") as f:
        json.dump(data, f)


def random_prompts(n_prompts: int = 3, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40)[:n_prompts]]
