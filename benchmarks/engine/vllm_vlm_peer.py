"""vLLM's side of the VLM benchmark (issue 37): bench_vlm.py's workload through vLLM's offline `LLM`, on the GPU
machine where vLLM is staged (the lead's .shared/bench/vllm/README.md), right after bench_vlm.py on the same
machine:

    PYTHONPATH=$HOME/site HF_HUB_OFFLINE=1 python3 benchmarks/engine/vllm_vlm_peer.py      # batches 1 16 64
    PYTHONPATH=$HOME/site HF_HUB_OFFLINE=1 python3 benchmarks/engine/vllm_vlm_peer.py --batches 16

The same model folder (LLaVA-1.5-7B's shape, written here by vlm_workload.py with vLLM's own transformers),
the same prompts in LLaVA-1.5's format ("USER: <image>\\n... \\nASSISTANT:"), each with its 448x448 noise image
as a PIL image in `multi_modal_data`, the same protocol and arithmetic (vlm_workload.measure_batches). vLLM's
settings: its defaults except dummy weights, bf16, max_model_len 2048, one image per prompt
(limit_mm_per_prompt), gpu_memory_utilization 0.88, seed 0, outputs not detokenized (as vllm_peer.py).

Prints a row per batch size and saves $OUT/vllm_vlm_peer.json (bench_vlm.json's shape).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

import vlm_workload  # noqa: E402
from bench_common import save  # noqa: E402


def engine_settings(llm) -> dict:
    """What vLLM chose (scheduler, cache, compilation), where its config says it."""
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    if cfg is None:
        return {}
    sc, cc = cfg.scheduler_config, cfg.compilation_config
    return dict(
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        chunked_prefill=getattr(sc, "enable_chunked_prefill", None),
        async_scheduling=getattr(sc, "async_scheduling", None),
        prefix_caching=getattr(cfg.cache_config, "enable_prefix_caching", None),
        compilation_mode=str(getattr(cc, "mode", getattr(cc, "level", None))),
        cudagraph_mode=str(getattr(cc, "cudagraph_mode", None)),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vlm_workload.add_arguments(p)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    shape = vlm_workload.SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        folder = vlm_workload.write_folder(os.path.join(tmp, "model"), shape)
        start = time.perf_counter()
        llm = LLM(
            model=folder,
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            limit_mm_per_prompt={"image": 1},
            seed=0,
        )
        startup_s = time.perf_counter() - start

        def generate(reqs: list, new_tokens: int) -> tuple[int, int]:
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
            prompts = [{"prompt": text, "multi_modal_data": {"image": image}} for text, image in reqs]
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.prompt_token_ids) for o in outs), sum(len(o.outputs[0].token_ids) for o in outs)

        rows = vlm_workload.measure_batches(generate, llm.reset_prefix_cache, shape, args)
    settings = dict(
        vllm=vllm.__version__,
        startup_s=round(startup_s, 1),
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device=torch.cuda.get_device_name(),
        **engine_settings(llm),
    )
    print(f"vLLM {vllm.__version__}, {args.shape} (dummy weights), {args.image_size}px images, {args.new_tokens} new")
    print(vlm_workload.format_rows(rows))
    save("vllm_vlm_peer", vlm_workload.result("vllm", args.shape, args, rows, settings))


if __name__ == "__main__":
    main()
