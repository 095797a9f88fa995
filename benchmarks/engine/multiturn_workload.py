"""bench_multiturn's workload, shared with vLLM's side of it (vllm_multiturn_peer.py): made-up conversations of
token ids, the users who send them, and the figures of a run. No plait or vLLM import here: each engine's script
brings its own `generate`.

`conversations` conversations of `rounds` rounds: each opens with its own `first_tokens` message, and every round
adds the previous answer and a new `turn_tokens` user message, then asks for `output_tokens` tokens (greedy, exact
lengths). `users` clients run at once, each working through its share of the conversations one round at a time
(its round r of every conversation it holds before any round r + 1), so between two turns of a conversation every
other conversation runs. With `--think-time S` each user waits an exponential pause of mean S seconds (its own
seed) before each request, as a person reads an answer and types the next turn, so returning turns arrive spread
out; without it (closed loop) users with equal output lengths finish together and come back together: in waves,
each wave's turns loaded and prefilled together.
"""

from __future__ import annotations

import random

VOCAB_LO, VOCAB_HI = 100, 29000  # token ids of the made-up messages (inside the tiny model's vocabulary)


def make_conversations(n: int, first: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(first)] for _ in range(n)]


def make_turns(conversations: int, rounds: int, turn_tokens: int) -> dict[int, list[list[int]]]:
    """Each conversation's user message of each round."""
    rng = random.Random(2)
    return {
        c: [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(turn_tokens)] for _ in range(rounds)]
        for c in range(conversations)
    }


def working_set(args) -> int:
    """Tokens of every conversation's last-round prompt: what a cache would need to keep them all."""
    last = args.first_tokens + (args.rounds - 1) * (args.output_tokens + args.turn_tokens)
    return args.conversations * last


def add_arguments(p, cuda: bool) -> None:
    """The workload's flags (the same defaults on both engines' sides)."""
    p.add_argument("--conversations", type=int, default=64 if cuda else 16)
    p.add_argument("--rounds", type=int, default=6 if cuda else 4)
    p.add_argument("--first-tokens", type=int, default=1000 if cuda else 200)
    p.add_argument("--turn-tokens", type=int, default=200 if cuda else 40)
    p.add_argument("--output-tokens", type=int, default=100 if cuda else 16)
    p.add_argument("--users", type=int, default=16 if cuda else 4, help="clients sending at once")
    p.add_argument("--pool-factor", type=float, default=4.0, help="working set / device pool (sets max_total_tokens)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="the device pool (default: from --pool-factor)")
    p.add_argument("--hicache-ratio", type=float, default=4.0, help="host tier tokens per device pool token")
    p.add_argument(
        "--think-time", type=float, default=0.0, help="mean seconds a user pauses before each request (0: none)"
    )


def check_arguments(p, args) -> None:
    """The workload's flags that cannot work, named (argparse's `error`: a usage line and exit 2)."""
    if args.think_time < 0:
        p.error(f"--think-time is a mean pause in seconds, >= 0; got {args.think_time}")
    for name in ("conversations", "rounds", "first_tokens", "users"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def pauses(args, user: int):
    """Seconds user `user` waits before each of its requests: exponential with mean `think_time` (0: none)."""
    rng = random.Random(1000 + user)
    while True:
        yield rng.expovariate(1.0 / args.think_time) if args.think_time > 0 else 0.0


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(seconds: float, metas: list[dict]) -> dict:
    """A run's figures from each request's {ttft (s), prompt_tokens, completion_tokens, cached_tokens[, host]}."""
    ttfts = sorted(m["ttft"] for m in metas)
    prompt = sum(m["prompt_tokens"] for m in metas)
    output = sum(m["completion_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    host = sum(m.get("cached_tokens_details", {}).get("host", 0) for m in metas)
    rounds = sorted({m["round"] for m in metas if "round" in m})
    by_round = [[m["ttft"] for m in metas if m.get("round") == r] for r in rounds]
    return {
        # (the first round prefills every conversation whatever the cache; later rounds are what a tier serves)
        "ttft_mean_by_round_ms": [1e3 * sum(t) / len(t) for t in by_round],
        "seconds": seconds,
        "requests": len(metas),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "total_tok_s": (prompt + output) / seconds,
        "output_tok_s": output / seconds,
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "cached_ratio": cached / max(1, prompt),
        "cached_device_tokens": cached - host,
        "cached_host_tokens": host,
    }


def describe(label: str, res: dict) -> str:
    return (
        f"{label:12s} {res['seconds']:7.2f} s  {res['total_tok_s']:8.0f} tok/s  {res['output_tok_s']:6.0f} out tok/s  "
        f"TTFT mean {res['ttft_mean_s'] * 1e3:.0f} p50 {res['ttft_p50_s'] * 1e3:.0f} "
        f"p99 {res['ttft_p99_s'] * 1e3:.0f} ms  "
        f"cached {res['cached_ratio']:.1%} (device {res['cached_device_tokens']}, host {res['cached_host_tokens']})"
    )
