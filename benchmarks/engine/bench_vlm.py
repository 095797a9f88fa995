"""Image prefill and decode of a vision-language model (issue 37): LLaVA-1.5-7B's shape (CLIP ViT-L/14 at
336 pixels: 576 image tokens; the mlp2x_gelu projector; Llama-2-7B) with dummy weights, one 448x448 noise
image and ~32 text tokens per prompt, closed batches of 1 / 16 / 64 through the Engine, 128 new tokens.

Per batch size: image-prefill tok/s (prompt tokens, image tokens included, over the time of the batch run
with max_new_tokens=1) and decode tok/s (the full run's tokens after each request's first, over its time
less the prefill run's); protocol, model folder, prompts and images in vlm_workload.py, which vLLM's side,
vllm_vlm_peer.py, shares. CPU: a tiny random LLaVA (16 image tokens) at batch 1 / 2, end to end.

    python benchmarks/engine/bench_vlm.py                          # GPU: 7B shape, batches 1 16 64
    python benchmarks/engine/bench_vlm.py --batches 16 --step-timing
    python benchmarks/engine/bench_vlm.py                          # CPU (no GPU): tiny shape, batches 1 2

Prints a row per batch size and saves <results>/bench_vlm.json (vllm_vlm_peer.json's shape).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

import vlm_workload  # noqa: E402
from bench_common import format_breakdown, parse_engine_args, save, step_breakdown  # noqa: E402
from plait.runtime import Engine  # noqa: E402


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vlm_workload.add_arguments(p, gpu=cuda)
    p.add_argument("--context-length", type=int, default=2048, help="vllm_vlm_peer.py's max_model_len")
    p.add_argument("--step-timing", action="store_true", help="where the time went, per kind of step (all runs)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="more Engine settings")
    args = p.parse_args()
    engine_args = dict(
        load_format="dummy",
        context_length=args.context_length,
        max_running_requests=max(args.batches),
        enable_step_timing=args.step_timing,
        **parse_engine_args(args.engine_arg),
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = vlm_workload.write_folder(os.path.join(tmp, "model"), vlm_workload.SHAPES[args.shape])
        with Engine(model_path=folder, **engine_args) as eng:
            info = eng.get_server_info()
            before = eng.get_stats() if args.step_timing else None
            start = time.perf_counter()

            def generate(reqs: list, new_tokens: int) -> tuple[int, int]:
                outs = eng.generate(
                    prompt=[text for text, _ in reqs],
                    image_data=[image for _, image in reqs],
                    sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
                )
                return sum(o["meta_info"]["prompt_tokens"] for o in outs), sum(len(o["output_ids"]) for o in outs)

            rows = vlm_workload.measure_batches(generate, eng.flush_cache, vlm_workload.SHAPES[args.shape], args)
            seconds = time.perf_counter() - start
            steps = step_breakdown(before, eng.get_stats(), seconds) if before else None
    settings = dict(
        {
            k: info.get(k)
            for k in (
                "dtype",
                "attention_backend",
                "max_running_requests",
                "chunked_prefill_size",
                "max_num_batched_tokens",
            )
        },
        engine_args={k: v for k, v in engine_args.items() if k != "load_format"},
        device=torch.cuda.get_device_name() if cuda else "cpu",
    )
    print(f"plait, {args.shape} (dummy weights), {args.image_size}px images, {args.new_tokens} new tokens")
    print(vlm_workload.format_rows(rows))
    if steps is not None:
        print(format_breakdown(steps))
    out = vlm_workload.result("plait", args.shape, args, rows, settings)
    save("bench_vlm", dict(out, steps=steps) if steps else out)


if __name__ == "__main__":
    main()
