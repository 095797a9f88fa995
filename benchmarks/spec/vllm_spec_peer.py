"""vLLM's n-gram speculation beside bench_spec_gpu.py's `overhead` part, on the GPU machine (vLLM staged
with ../shared/bench/vllm: `PYTHONPATH=$HOME/site`).

    python3 benchmarks/spec/vllm_spec_peer.py off|ngram [--shape llama-8b] [--batch 1 8 64]

The same prompts as bench_spec_gpu's overhead part (a random 32-token span repeated 8 times, the same
generator and seed, batch sizes in the same order), 256 greedy tokens each with ignore_eos, dummy weights
at the real shape, three runs per batch size (median). `ngram`: speculative_config={"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}. Otherwise vLLM's
defaults, as ../shared/bench/vllm/vllm_peer.py sets them (bf16, max_model_len 2048, 0.88 of the GPU).
Prints one 'RESULT {json}' line per batch size, with the accept length where vLLM reports it.

`--plait-weights`: vLLM's dummy weights drawn as plait's are (norms 1, the rest uniform in +-0.02)
instead of vLLM's uniform +-0.001 everywhere, whose outputs repeat one token (prompt lookup then accepts
every draft): with plait's distribution the outputs loop as plait's do, so the accept lengths are alike.
It runs vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) to reach its loader.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

SHAPES = {
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
}


def model_dir(shape: str) -> str:
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        torch_dtype="bfloat16",
        bos_token_id=128000,
        eos_token_id=128001,
        attention_bias=False,
        mlp_bias=False,
        **SHAPES[shape],
    )
    folder = tempfile.mkdtemp(prefix=f"{shape}-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def overhead_prompts(batches: list[int]) -> dict[int, list[list[int]]]:
    """bench_spec_gpu.part_overhead's prompts, drawn the same way."""
    import torch

    gen = torch.Generator().manual_seed(1)
    prompts = {}
    for bs in batches:
        prompts[bs] = [torch.randint(100, 30000, (32,), generator=gen).tolist() * 8 for _ in range(bs)]
    return prompts


def spec_counters(llm) -> tuple[float, float]:
    """(drafts accepted, verify steps) so far, from vLLM's metrics (0, 0 where it has none)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an older or newer vLLM without it: no accept length
        return 0.0, 0.0
    accepted = drafts = 0.0
    for m in metrics:
        value = getattr(m, "value", None)
        if m.name == "vllm:spec_decode_num_accepted_tokens" and value is not None:
            accepted += value
        elif m.name == "vllm:spec_decode_num_drafts" and value is not None:
            drafts += value
    return accepted, drafts


def use_plait_dummy_weights() -> None:
    import torch
    from vllm.model_executor.model_loader import dummy_loader, weight_utils

    def plait_like(model, *args, **kwargs):
        gen = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif p.is_floating_point():
                    p.uniform_(-0.02, 0.02, generator=gen if p.is_cuda else None)

    weight_utils.initialize_dummy_weights = plait_like
    dummy_loader.initialize_dummy_weights = plait_like


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["off", "ngram"])
    ap.add_argument("--shape", default="llama-8b", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--plait-weights", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.plait_weights:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams

    if args.plait_weights:
        use_plait_dummy_weights()

    spec = None
    if args.mode == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir(args.shape),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        gpu_memory_utilization=0.88,
        seed=0,
        speculative_config=spec,
        disable_log_stats=False,
    )
    print(
        "SETTINGS "
        + json.dumps(
            {
                "vllm": vllm.__version__,
                "shape": args.shape,
                "mode": args.mode,
                "plait_weights": args.plait_weights,
                "speculative_config": spec,
                "startup_s": round(time.perf_counter() - t0, 1),
            }
        ),
        flush=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    prompts = overhead_prompts(args.batch)
    llm.generate(
        [{"prompt_token_ids": prompts[args.batch[0]][0]}],
        SamplingParams(max_tokens=8, detokenize=False),
        use_tqdm=False,
    )  # warm-up
    for bs in args.batch:
        before = spec_counters(llm)
        secs = []
        for _ in range(args.runs):
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[bs]], params, use_tqdm=False)
            secs.append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        accepted, drafts = (a - b for a, b in zip(spec_counters(llm), before))
        print(
            "RESULT "
            + json.dumps(
                {
                    "mode": args.mode,
                    "batch": bs,
                    "tok_s": round(bs * args.output_len / statistics.median(secs), 1),
                    "runs_s": [round(s, 3) for s in secs],
                    "accept_length": round(1 + accepted / drafts, 3) if drafts else None,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
