"""Speculative decoding against decoding without it, in the same run.

CPU (default; the embedded SmolLM2-135M, greedy), three workloads, each mode an Engine of its own, all
alive at once and run interleaved (the order rotates every repeat) so the machine's load hits them alike;
medians over the repeats:

- json: JSON extraction under a 5-field schema (bench_grammar.py's prompts and schema). Modes: plain
  constrained decoding (neither jump-forward nor drafts: the reference), jump-forward (plait's decoding
  before speculation, and the default), grammar-forced drafts (`speculative_grammar_drafts="on"`: forced
  tokens, and prompt lookup where nothing is forced).
- copy: summarise / quote the context (RAG-like: answers copy sentences of a passage). Modes: off, NGRAM.
- chat: free chat (little to copy: the overhead when drafts do not pay). Modes: off, NGRAM.

Reported per workload and mode: output tokens/s, the speedup over the reference, the accept length
(tokens per request-step with drafts) and whether every output is token for token the reference's.
`--batch 1` sends the requests one at a time (latency: where speculation pays); a larger value sends
them in groups of that size.

    python benchmarks/spec/bench_spec.py --threads 1 --repeats 5
    python benchmarks/spec/bench_spec.py --device cuda ...      # the GPU parts: bench_spec_gpu.py

Prints a table and writes JSON to $OUT or benchmarks/out (bench_spec.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [BENCHMARKS, os.path.join(BENCHMARKS, "grammar")]  # bench_common; bench_grammar's JSON workload

from bench_common import save  # noqa: E402
from bench_grammar import SCHEMA, chat  # noqa: E402
from bench_grammar import workload as json_prompts  # noqa: E402

PASSAGES = [
    "The old lighthouse on the northern cliff was built in 1871 by a shipwright named Elias Morrow, who carried "
    "every stone up the path himself. Its lamp burned whale oil until 1903, then kerosene, and finally "
    "electricity after the war. The keeper's log, kept in a tin box, records three shipwrecks and one wedding.",
    "Maple syrup takes about forty litres of sap to make one litre of syrup. The sap runs when nights are below "
    "freezing and days are above it, usually for four to six weeks in early spring. Farmers boil it in wide "
    "shallow pans so the water evaporates quickly, and they stop when the syrup reaches 66 percent sugar.",
    "The city council voted on Tuesday to close Harbour Street to cars on weekends from June to September. "
    "Shops on the street asked for the change after a trial last summer doubled the number of visitors. The "
    "first car-free weekend begins on the seventh of June, and buses will be rerouted along Quay Road.",
    "Honeybees communicate the location of flowers with a waggle dance. The angle of the dance shows the "
    "direction relative to the sun, and the length of the waggle run shows the distance. A bee that has "
    "found a rich patch dances longer and with more energy, and more of its sisters follow it out.",
    "The library will move to the former post office building in March. The new site has twice the floor "
    "space, a children's reading room and a workshop for repairing old books. During the move, from the "
    "first to the twentieth of March, borrowed books can be returned at the town hall.",
    "Copper turns green over time because it reacts with water, carbon dioxide and sulfur in the air. The "
    "green layer, called a patina, protects the metal underneath from further corrosion. The Statue of "
    "Liberty took about thirty years to turn from shiny brown to the pale green it is today.",
]
TASKS = [
    "Repeat the passage word for word.",
    "Quote the passage's first two sentences exactly.",
    "Summarise the passage, quoting its most important sentence in full.",
]
CHATS = [
    "Write a short story about a cat who learns to swim.",
    "Explain how a rainbow forms, for a child.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "What makes a good cup of tea? Be brief.",
    "Describe your ideal holiday in a few sentences.",
    "Write a limerick about a forgetful wizard.",
]

# Engine settings of each mode (every engine: the default model, greedy requests).
MODES = {
    "plain": dict(disable_jump_forward=True, speculative_grammar_drafts="off"),
    "jump_forward": dict(speculative_grammar_drafts="off"),
    "grammar_drafts": dict(speculative_grammar_drafts="on"),
    "ngram": dict(speculative_algorithm="NGRAM"),
}
WORKLOADS = {
    "json": ("plain", ["plain", "jump_forward", "grammar_drafts"]),
    "copy": ("jump_forward", ["jump_forward", "ngram"]),
    "chat": ("jump_forward", ["jump_forward", "ngram"]),
}
LABELS = {"jump_forward": "off"}  # for unconstrained workloads the jump-forward engine is plain decoding


def prompts_of(name: str, tok, n: int) -> tuple[list[str], dict]:
    if name == "json":
        return [chat(tok, p) for p in json_prompts(n)], {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 64}
    if name == "copy":
        texts = [f"{PASSAGES[i % len(PASSAGES)]}\n\n{TASKS[(i // len(PASSAGES)) % len(TASKS)]}" for i in range(n)]
        return [chat(tok, t) for t in texts], {"max_new_tokens": 96}
    return [chat(tok, CHATS[i % len(CHATS)]) for i in range(n)], {"max_new_tokens": 64}


def spec_counts(stats: dict) -> tuple[int, int]:
    return stats.get("spec_verify_steps", 0), stats.get("spec_accepted_tokens", 0)


def run_once(eng, prompts: list[str], params: dict, batch: int) -> tuple[float, list[dict], float]:
    """(seconds, outputs, accept length) of the workload on one engine."""
    eng.flush_cache()
    before = spec_counts(eng.get_stats())
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        got = eng.generate(group if batch > 1 else group[0], {**params, "temperature": 0})
        outs.extend(got if isinstance(got, list) else [got])
    secs = time.perf_counter() - start
    steps, acc = (a - b for a, b in zip(spec_counts(eng.get_stats()), before))
    return secs, outs, (acc + steps) / steps if steps else 0.0


def bench_cpu(args) -> dict:
    from plait.runtime import Engine

    names = args.workloads
    needed = sorted({m for w in names for m in WORKLOADS[w][1]}, key=list(MODES).index)
    engines = {m: Engine(num_threads=args.threads, max_total_tokens=16384, **MODES[m]) for m in needed}
    try:
        tok = next(iter(engines.values())).tokenizer
        work = {w: prompts_of(w, tok, args.n) for w in names}
        for eng in engines.values():
            eng.generate(work[names[0]][0][0], {"max_new_tokens": 4})  # warm-up
        runs: dict = {w: {m: [] for m in WORKLOADS[w][1]} for w in names}
        for rep in range(args.repeats):
            for w in names:
                modes = WORKLOADS[w][1]
                for m in modes[rep % len(modes) :] + modes[: rep % len(modes)]:  # rotate the order
                    secs, outs, accept = run_once(engines[m], *work[w], args.batch)
                    runs[w][m].append((secs, outs, accept))
                    print(f"  rep {rep} {w:5s} {LABELS.get(m, m) if w != 'json' else m:15s} {secs:7.2f} s", flush=True)
        return summarize(runs)
    finally:
        for eng in engines.values():
            eng.shutdown()


def summarize(runs: dict) -> dict:
    result = {}
    for w, by_mode in runs.items():
        ref_mode = WORKLOADS[w][0]
        ref_ids = [o["output_ids"] for o in by_mode[ref_mode][0][1]]
        ref_secs = statistics.median(s for s, _, _ in by_mode[ref_mode])
        rows = {}
        for m, reps in by_mode.items():
            secs = statistics.median(s for s, _, _ in reps)
            tokens = sum(o["meta_info"]["completion_tokens"] for o in reps[0][1])
            same = [sum(o["output_ids"] == r for o, r in zip(outs, ref_ids)) for _, outs, _ in reps]
            label = m if w == "json" else LABELS.get(m, m)
            rows[label] = {
                "median_s": round(secs, 3),
                "runs_s": [round(s, 3) for s, _, _ in reps],
                "output_tokens": tokens,
                "tok_per_s": round(tokens / secs, 2),
                "speedup": round(ref_secs / secs, 3),
                "accept_length": round(statistics.median(a for _, _, a in reps), 2),
                "identical": f"{min(same)}/{len(ref_ids)}",
            }
        result[w] = rows
    return result


def print_table(result: dict, args) -> None:
    print(
        f"\nspeculative decoding, CPU, default model, greedy, num_threads={args.threads}, batch {args.batch}, "
        f"{args.n} requests, median of {args.repeats} interleaved runs"
    )
    print(f"{'workload':8s} {'mode':15s} {'tok/s':>8s} {'speedup':>8s} {'accept':>7s} {'identical':>10s}")
    for w, rows in result.items():
        for m, r in rows.items():
            print(
                f"{w:8s} {m:15s} {r['tok_per_s']:8.2f} {r['speedup']:7.2f}x {r['accept_length']:7.2f} "
                f"{r['identical']:>10s}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--n", type=int, default=6, help="requests per workload")
    ap.add_argument("--batch", type=int, default=1, help="requests sent together (1: one at a time)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads of each engine")
    args, rest = ap.parse_known_args()
    if args.device == "cuda":
        from bench_spec_gpu import main as gpu_main  # noqa: E402

        sys.argv = [sys.argv[0], *rest]
        return gpu_main()
    result = bench_cpu(args)
    print_table(result, args)
    save(
        "bench_spec",
        {
            "device": "cpu",
            "threads": args.threads,
            "batch": args.batch,
            "n": args.n,
            "repeats": args.repeats,
            "result": result,
        },
    )


if __name__ == "__main__":
    main()
