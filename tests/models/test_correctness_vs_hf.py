"""Greedy outputs equal Hugging Face transformers token for token, on the same weights.

Covers: the real default model (alone and batched, radix cache on and off), random small Llama /
Qwen2 / Qwen3 models, a tiny chunked_prefill_size, and a KV pool small enough to force retraction.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy
from plait.runtime import Engine
from transformers import AutoModelForCausalLM

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves falling on a quiet river at dusk.",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def reference(hf_default_model, default_tokenizer):
    ids = [default_tokenizer.encode(p) for p in PROMPTS]
    eos = [default_tokenizer.eos_token_id]
    return ids, [hf_greedy(hf_default_model, x, GREEDY["max_new_tokens"], eos) for x in ids]


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_default_model_alone_and_batched(reference, disable_radix_cache):
    ids, expected = reference
    with Engine(disable_radix_cache=disable_radix_cache) as eng:
        alone = [eng.generate(input_ids=x, sampling_params=GREEDY)["output_ids"] for x in ids]
        batched = [o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=GREEDY)]
        # Second pass hits the prefix cache (when on) and must not change anything.
        again = [o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=GREEDY)]
        assert eng.check_integrity()
    assert alone == expected
    assert batched == expected
    assert again == expected


@pytest.mark.parametrize("mixed", [True, False])
def test_default_model_tiny_chunks_and_retraction(reference, mixed):
    ids, expected = reference
    # chunked_prefill_size 7 splits every prompt; the KV pool cannot hold five requests at once, so
    # decoding retracts requests and resumes them later. (With mixed steps, decode tokens take 7-token
    # steps first and prefill proceeds more slowly: a smaller pool makes the same pressure.)
    pool = 110 if mixed else 160
    with Engine(
        chunked_prefill_size=7, max_prefill_tokens=7, max_total_tokens=pool, disable_mixed_chunk=not mixed
    ) as eng:
        outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
        stats = eng.get_stats()
        assert eng.check_integrity()
        assert stats["free_tokens"] + stats["evictable_tokens"] == stats["max_total_tokens"]
    assert [o["output_ids"] for o in outs] == expected
    assert stats["num_retractions"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_random_models_match_transformers(random_models, arch):
    path = random_models[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    sp = {"temperature": 0, "max_new_tokens": 20}
    expected = [hf_greedy(hf, p, 20, [1]) for p in prompts]
    with Engine(model_path=path, chunked_prefill_size=16) as eng:
        batched = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
        alone = [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    assert batched == expected
    assert alone == expected


def test_prompt_logprobs_match_transformers(random_models):
    path = random_models["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompt = list(range(5, 30))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    expected = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    with Engine(model_path=path) as eng:
        out = eng.generate(
            input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )
        # Same request again: the prefix is cached now but the prompt logprobs must be recomputed.
        again = eng.generate(
            input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )
    for o in (out, again):
        got = o["meta_info"]["input_token_logprobs"]
        assert got[0][0] is None and got[0][1] == prompt[0]
        assert [t for _, t, _ in got] == prompt
        assert torch.allclose(torch.tensor([lp for lp, _, _ in got[1:]]), torch.tensor(expected), atol=1e-4)
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert o["output_ids"] == []
