"""llama.cpp's side of bench_offline.py's CPU workload: the same prompt token ids through llama-cpp-python on the
GGUF the default model ships in (Q4_1, as llama.cpp runs it: never widened), greedy, exactly `--output-len` tokens
each (its `generate` does not stop at EOS), one sequence at a time (llama-cpp-python's API has no batching), with
as many threads as cores. Runs under a Python that has llama-cpp-python (built from source: PyPI has no wheel);
bench_offline.py `--llamacpp-python` calls it and reads the JSON it prints last.

    /tmp/lvenv/bin/python benchmarks/engine/llamacpp_peer.py --gguf MODEL.gguf --ids ids.json --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--ids", required=True, help="a JSON list of prompts, each a list of token ids")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    from llama_cpp import Llama

    with open(args.ids) as f:
        prompts = json.load(f)
    ctx = max(map(len, prompts)) + args.output_len + 8
    llm = Llama(model_path=args.gguf, n_ctx=ctx, n_threads=args.threads, n_batch=512, verbose=False)

    def run(ids: list[int]) -> int:
        n = 0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == args.output_len:
                break
        return n

    run(prompts[0][:16])  # warm-up
    start = time.perf_counter()
    got = sum(run(ids) for ids in prompts)
    seconds = time.perf_counter() - start
    print(
        json.dumps({"seconds": seconds, "output_tokens": got, "output_tok_s": got / seconds, "threads": args.threads})
    )


if __name__ == "__main__":
    main()
