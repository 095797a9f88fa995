"""Random small LoRA adapters in PEFT's format, and transformers' greedy outputs with one merged in: the
reference the LoRA tests compare plait with."""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base: str, folder: str, rank: int, seed: int, targets=None, alpha=None, scale=0.15) -> str:
    """A PEFT LoRA adapter on the model at `base` (random A and B of standard deviation `scale`; B non-zero:
    PEFT starts it at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets or ALL_TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(folder)
    return folder


def merged_greedy(base: str, adapter, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers + PEFT, the adapter merged into the weights (None: the base model): greedy ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs
