"""Speculative decoding's machinery on a GPU, with dummy (random) weights at the 8B / 1B shapes: random weights
make real acceptance meaningless, so this measures what the verify path costs and what a given accept
length buys. Three parts (`python benchmarks/spec/bench_spec.py --device cuda --parts cost oracle overhead`):

- cost: a VERIFY step of k = 2..8 tokens per request (the last committed one and k - 1 chain drafts,
  CUDA graphs on) against a plain decode step, at batch 1, 8, 32: median milliseconds and the ratio.
- oracle: decoding with drafts whose acceptance is controlled: every step verifies 4 drafts per request
  and keeps the first `a` of them plus the target's own token, `a` drawn so that each draft survives with
  probability p (the accept rate of a draft model that agrees with the target that often); KV and table
  bookkeeping as the scheduler's. Output tokens/s against plain decoding, at batch 1 and 32, p in
  1.0 / 0.8 / 0.5 / 0. And "4 of 5": 5 drafts a step, the first 4 the target's own greedy continuation
  (recorded by the plain run), the 5th wrong, accepted by the runner's verifier: 5 tokens a step.
  Target: >= 2.5x plain at batch 1 when 4 of 5 drafts are accepted.
- overhead: the Engine with NGRAM on prompts whose repeated spans make prompt lookup propose drafts that
  random weights never accept, against the Engine without speculation, back to back, batch 1 / 8 / 64;
  with the adaptive off switch (default) and without it; one engine per mode serves the batch sizes in turn.
  Target: <= 5% slower (or speculation off).

vLLM's n-gram speculation beside `overhead` is run with ../shared/bench/vllm's staging (see its README;
speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402

SHAPES = {"8b": "llama-3.1-8b", "1b": "llama-3.2-1b"}


def _runner(model: str, max_bs: int, tokens: int, nodes: int):
    from plait.runtime.executor.model_runner import ModelRunner
    from plait.runtime.server_args import ServerArgs

    sa = ServerArgs(
        model_path=model,
        load_format="dummy",
        max_total_tokens=max_bs * (tokens + 16) + 1024,
        max_running_requests=max_bs,
        cuda_graph_max_bs=max_bs,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=nodes,
        speculative_num_steps=nodes - 1,
        speculative_disable_by_batch_size=max_bs,
        context_length=tokens + 64,
    )
    mr = ModelRunner(sa, model)
    mr.capture_verify_graphs(nodes, max_bs)
    return mr


class _Batch:
    """B requests prefilled with `input_len` random tokens, their KV bookkept by hand."""

    def __init__(self, mr, bs: int, input_len: int, gen: torch.Generator):
        from plait.runtime.sampling_params import SamplingParams
        from plait.runtime.step import SamplingRow, StepInput

        self.mr, self.bs = mr, bs
        self.rows = [mr.req_to_token_pool.alloc() for _ in range(bs)]
        self.kv_lens = [input_len] * bs
        self.sampling = [
            SamplingRow(SamplingParams(temperature=0, max_new_tokens=1 << 20), [], [], set()) for _ in range(bs)
        ]
        ids = torch.randint(100, min(30000, mr.info.vocab_size), (bs * input_len,), generator=gen).tolist()
        loc = mr.allocator.alloc(bs * input_len).numpy()
        step = StepInput.extend(self.rows, [0] * bs, [input_len] * bs, ids, loc)
        step.sample_rows = [i * input_len + input_len - 1 for i in range(bs)]
        step.sampling_reqs, step.sampling = list(range(bs)), self.sampling
        self.last = mr.run(step).next_token_ids
        self.held = [list(loc[i * input_len : (i + 1) * input_len]) for i in range(bs)]

    def decode(self) -> None:
        from plait.runtime.forward_batch import ForwardMode
        from plait.runtime.step import StepInput

        loc = self.mr.allocator.alloc(self.bs).numpy()
        pre = np.asarray(self.kv_lens, dtype=np.int64)
        rows = np.stack([np.asarray(self.last), pre, np.asarray(self.rows), pre + 1, loc])
        step = StepInput(
            ForwardMode.DECODE,
            self.bs,
            rows,
            (pre + 1).tolist(),
            (rows[2], rows[1], rows[4]),
            sample_rows=list(range(self.bs)),
            sampling_reqs=list(range(self.bs)),
            sampling=self.sampling,
        )
        self.last = self.mr.run(step).next_token_ids
        for i in range(self.bs):
            self.kv_lens[i] += 1
            self.held[i].append(int(loc[i]))

    def verify(self, drafts: list[list[int]], keep: Optional[list[int]] = None) -> int:
        """A verify step of these chains; request i keeps keep[i] drafts (+ the target's token), or, with
        keep None, the drafts the runner's verifier accepted. Tokens out."""
        from plait.runtime.speculative.tree import DraftTree
        from plait.runtime.speculative.verify_step import build_verify_step

        trees = [DraftTree.chain(int(t), d) for t, d in zip(self.last, drafts)]
        n = sum(t.size for t in trees)
        loc = self.mr.allocator.alloc(n).numpy()
        step = build_verify_step(self.rows, self.kv_lens, trees, loc)
        step.sampling_reqs, step.sampling = list(range(self.bs)), self.sampling
        out = self.mr.run(step)
        if keep is None:
            keep = [len(v.nodes) for v in out.verified]
        freed, at = [], 0
        for i, t in enumerate(trees):
            k = keep[i] + 1  # the root and the kept drafts hold KV now
            self.held[i].extend(int(x) for x in loc[at : at + k])
            freed.extend(int(x) for x in loc[at + k : at + t.size])
            self.kv_lens[i] += k
            at += t.size
        self.mr.allocator.free(torch.tensor(freed, dtype=torch.int64))
        self.last = out.next_token_ids
        return sum(k + 1 for k in keep)

    def release(self) -> None:
        for row, held in zip(self.rows, self.held):
            self.mr.allocator.free(torch.tensor(held, dtype=torch.int64))
            self.mr.req_to_token_pool.free(row)


def _ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e3


def part_cost(args) -> list[dict]:
    rows = []
    for shape in args.shapes:
        mr = _runner(SHAPES[shape], max(args.batch_sizes), args.input_len + 8 * args.reps + 64, 8)
        gen = torch.Generator().manual_seed(0)
        for bs in args.batch_sizes:
            b = _Batch(mr, bs, args.input_len, gen)
            decode_ms = _ms(b.decode, args.reps)
            for k in range(2, 9):
                drafts = [[7] * (k - 1) for _ in range(bs)]
                verify_ms = _ms(lambda: b.verify(drafts, [0] * bs), args.reps)
                rows.append(
                    {
                        "shape": shape,
                        "batch": bs,
                        "tokens_per_request": k,
                        "decode_ms": round(decode_ms, 3),
                        "verify_ms": round(verify_ms, 3),
                        "ratio": round(verify_ms / decode_ms, 3),
                    }
                )
                print(
                    f"cost {shape} bs={bs:3d} k={k} decode {decode_ms:7.3f} ms verify {verify_ms:7.3f} ms "
                    f"({verify_ms / decode_ms:4.2f}x)",
                    flush=True,
                )
            b.release()
        del mr
        torch.cuda.empty_cache()
    return rows


def part_oracle(args) -> list[dict]:
    rows, drafts_per_step = [], 4
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        # 6 nodes: the 4-of-5 case verifies 5 drafts a step
        mr = _runner(SHAPES[shape], max(args.oracle_batch), args.input_len + args.output_len + 64, 6)
        for bs in args.oracle_batch:
            b = _Batch(mr, bs, args.input_len, torch.Generator().manual_seed(bs))
            greedy = [[int(t)] for t in b.last]  # each request's own greedy continuation, from its prefill
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.output_len):
                b.decode()
                for g, tok in zip(greedy, b.last):
                    g.append(int(tok))
            torch.cuda.synchronize()
            plain = bs * args.output_len / (time.perf_counter() - t)
            for _ in range(12):  # the continuation past output_len, for the last steps' drafts
                b.decode()
                for g, tok in zip(greedy, b.last):
                    g.append(int(tok))
            b.release()

            def report(label: str, p: Optional[float], made: int, steps: int, seconds: float) -> None:
                tok_s = made / seconds
                rows.append(
                    {
                        "shape": shape,
                        "batch": bs,
                        "case": label,
                        "draft_accept_rate": p,
                        "accept_length": made / (steps * bs),
                        "tok_s": round(tok_s, 1),
                        "plain_tok_s": round(plain, 1),
                        "speedup": round(tok_s / plain, 3),
                    }
                )
                print(
                    f"oracle {shape} bs={bs:3d} {label:10s} accept length {made / (steps * bs):4.2f} "
                    f"{tok_s:9.1f} tok/s (plain {plain:9.1f}: {tok_s / plain:4.2f}x)",
                    flush=True,
                )

            for p in (1.0, 0.8, 0.5, 0.0):
                b = _Batch(mr, bs, args.input_len, torch.Generator().manual_seed(bs))
                made, steps = 0, 0
                torch.cuda.synchronize()
                t = time.perf_counter()
                while made < bs * args.output_len:
                    # each draft survives with probability p: keep the run before the first that does not
                    keep = [int(np.argmin(np.append(rng.random(drafts_per_step) < p, False))) for _ in range(bs)]
                    made += b.verify([[11] * drafts_per_step for _ in range(bs)], keep)
                    steps += 1
                torch.cuda.synchronize()
                report(f"p={p:.1f}", p, made, steps, time.perf_counter() - t)
                b.release()
            # 4 of 5 drafts accepted, by the verifier itself: 5 drafts a step, the first 4 the target's own
            # greedy continuation (recorded above from the same prompts), the 5th a token it did not write:
            # 5 tokens a step (fewer where the verify step's numerics pick another argmax than decoding's;
            # the accept length printed says).
            b = _Batch(mr, bs, args.input_len, torch.Generator().manual_seed(bs))
            made, steps, at = 0, -(-args.output_len // 5), [1] * bs  # at: tokens of each continuation committed
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                drafts = [g[a : a + 4] + [(g[a + 4] + 1) % mr.info.vocab_size] for g, a in zip(greedy, at)]
                before = list(b.kv_lens)
                made += b.verify(drafts)
                at = [a + (k - k0) for a, k, k0 in zip(at, b.kv_lens, before)]
            torch.cuda.synchronize()
            report("4 of 5", None, made, steps, time.perf_counter() - t)
            b.release()
        del mr
        torch.cuda.empty_cache()
    return rows


def part_overhead(args) -> list[dict]:
    from plait.runtime import Engine

    rows = []
    gen = torch.Generator().manual_seed(1)
    modes = {
        "off": {},
        "ngram": {"speculative_algorithm": "NGRAM"},
        "ngram, no adaptation": {"speculative_algorithm": "NGRAM", "disable_speculative_adaptive": True},
    }
    for shape in args.shapes:
        prompts = {}
        for bs in args.overhead_batch:
            prompts[bs] = []
            for _ in range(bs):
                span = torch.randint(100, 30000, (32,), generator=gen).tolist()
                prompts[bs].append(span * 8)  # every 2-gram of the output's start was seen: lookups propose
        params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        result: dict = {bs: {} for bs in args.overhead_batch}
        # One engine per mode, every batch size through it in turn (as a server sees them: the cost
        # model's measurements carry over); the accept length is each batch size's own.
        for label, kw in modes.items():
            with Engine(model_path=SHAPES[shape], load_format="dummy", **kw) as eng:
                eng.generate(input_ids=prompts[args.overhead_batch[0]][0], sampling_params={"max_new_tokens": 8})
                for bs in args.overhead_batch:
                    before = eng.get_stats()
                    secs = []
                    for _ in range(args.overhead_runs):
                        eng.flush_cache()
                        t = time.perf_counter()
                        eng.generate(input_ids=prompts[bs], sampling_params=params)
                        secs.append(time.perf_counter() - t)
                    st = eng.get_stats()
                    steps = st["spec_verify_steps"] - before["spec_verify_steps"]
                    accepted = st["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                    result[bs][label] = {
                        "tok_s": bs * args.output_len / statistics.median(secs),
                        "accept_length": (accepted + steps) / steps if steps else 0.0,
                        "verify_steps": steps,
                        # the speculation guard's measured rates by policy (tok/s) at this size
                        "guard": (st.get("spec_guard") or {}).get(bs),
                    }
        for bs in args.overhead_batch:
            off = result[bs]["off"]["tok_s"]
            for label, r in result[bs].items():
                rows.append(
                    {
                        "shape": shape,
                        "batch": bs,
                        "mode": label,
                        "tok_s": round(r["tok_s"], 1),
                        "vs_off": round(r["tok_s"] / off, 3),
                        "accept_length": round(r["accept_length"], 3),
                        "verify_request_steps": r["verify_steps"],
                        "guard": r["guard"],
                    }
                )
                print(
                    f"overhead {shape} bs={bs:3d} {label:22s} {r['tok_s']:9.1f} tok/s ({r['tok_s'] / off:5.3f} of off, "
                    f"accept length {r['accept_length']:4.2f}, {r['verify_steps']} request-steps verified)"
                    + (f" guard {r['guard']}" if r["guard"] else ""),
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["cost", "oracle", "overhead"])
    ap.add_argument("--shapes", nargs="+", default=["8b", "1b"], choices=list(SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--oracle-batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--overhead-batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--overhead-runs", type=int, default=3, help="runs per batch size and mode (median)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(0)}
    for part in args.parts:
        out[part] = {"cost": part_cost, "oracle": part_oracle, "overhead": part_overhead}[part](args)
    save("bench_spec_gpu", out)


if __name__ == "__main__":
    main()
