"""Structured generation on the CPU, plait's Engine beside Outlines (issue 38): the same model, prompts and
constraints, greedy, each engine batched, on one machine in one run.

Workloads (the default model SmolLM2-135M-Instruct through its chat template):
  json    16 extractions into bench_extraction.py's 5-field schema (its first 16 texts), 96 new tokens at most;
          scored as there: schema-valid share and fields right
  regex   16 questions about the dates of events, answered as YYYY-MM-DD through one date regex, 16 new tokens
          at most; scored: the share that matches the regex in full
  choice  32 short reviews labelled positive / negative / neutral (a regex alternation for plait, a Literal for
          Outlines: both compile it to the same kind of automaton), 8 new tokens at most; scored: valid share and
          labels right

Outlines needs its own environment (it pins transformers and outlines-core versions plait does not share), so
each engine runs in its own process: this script with `--engine plait` under plait's Python, with `--engine
outlines` under Outlines' (`--outlines-python`), and without `--engine` it drives both, alternating, `--repeats`
times, and prints the median seconds of each workload and the ratio:

    python -m venv /tmp/ovenv && /tmp/ovenv/bin/pip install torch==2.13.0 outlines==1.3.3 transformers
    .venv/bin/python benchmarks/grammar/vs_outlines.py --outlines-python /tmp/ovenv/bin/python

`--dtype bfloat16` runs both engines in bf16 (on CPUs with AVX512-BF16 or AMX). Both engines use every core
torch sees (2 on the developers' machines); the first call of each workload in a process is a warm-up (model,
grammar compile) and not timed. Saves benchmarks/out/vs_outlines_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench_extraction beside this file, bench_common above

from bench_extraction import FIELDS, INSTRUCTION, SCHEMA, TEXTS, parse  # noqa: E402
from bench_extraction import score as score_extraction  # noqa: E402

JSON_TEXTS = TEXTS[:16]

# Dates of events, one format for every question (Outlines batches prompts of one output type), as YYYY-MM-DD.
DATE_REGEX = r"(1[0-9]|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EVENTS = [
    "the Apollo 11 landing on the Moon",
    "the fall of the Berlin Wall",
    "the first flight of the Wright brothers",
    "the signing of the US Declaration of Independence",
    "the sinking of the Titanic",
    "the end of the Second World War in Europe",
    "the storming of the Bastille",
    "the first iPhone's announcement",
    "the launch of Sputnik 1",
    "the opening of the Eiffel Tower",
    "the assassination of Archduke Franz Ferdinand",
    "the first modern Olympic Games' opening",
    "Neil Armstrong's birth",
    "the founding of the United Nations",
    "the first ascent of Mount Everest",
    "the release of the first Harry Potter book",
]
REGEX_QUESTIONS = [f"On what date did {e} happen? Answer with the date only, as YYYY-MM-DD." for e in EVENTS]

LABELS = ("positive", "negative", "neutral")
REVIEWS = [
    ("The battery lasts all day and the screen is gorgeous.", "positive"),
    ("It broke after two days and support never answered.", "negative"),
    ("The package arrived on Tuesday.", "neutral"),
    ("Best pizza I have had in years, friendly staff too.", "positive"),
    ("The room was dirty and smelled of smoke.", "negative"),
    ("The manual has twelve pages.", "neutral"),
    ("I love how light these headphones are.", "positive"),
    ("Terrible sound quality, I returned them.", "negative"),
    ("The store opens at nine.", "neutral"),
    ("A wonderful film with a moving ending.", "positive"),
    ("The plot made no sense and the acting was wooden.", "negative"),
    ("The film is two hours long.", "neutral"),
    ("Fast delivery and the shoes fit perfectly.", "positive"),
    ("The shoes fell apart in the rain.", "negative"),
    ("The shoes come in black and brown.", "neutral"),
    ("Our guide was funny and knew everything about the castle.", "positive"),
    ("The tour was rushed and overpriced.", "negative"),
    ("The tour starts at the main gate.", "neutral"),
    ("This blender crushes ice like a dream.", "positive"),
    ("The blender leaked all over my counter.", "negative"),
    ("The blender has three speeds.", "neutral"),
    ("The app is quick and the design is clean.", "positive"),
    ("The app crashes every time I open it.", "negative"),
    ("The app was updated last week.", "neutral"),
    ("Delicious coffee and a cosy place to read.", "positive"),
    ("The coffee was cold and bitter.", "negative"),
    ("The cafe is next to the station.", "neutral"),
    ("The hotel staff upgraded our room for free, amazing!", "positive"),
    ("Noisy all night, I could not sleep at all.", "negative"),
    ("The hotel has four floors.", "neutral"),
    ("My kids adore this board game.", "positive"),
    ("Pieces were missing from the box.", "negative"),
]
CHOICE_INSTRUCTION = "Is the sentiment of this review positive, negative or neutral? Answer with one word.\n\nReview: "
WORKLOADS = ("json", "regex", "choice")
MAX_NEW = {"json": 96, "regex": 16, "choice": 8}


def user_messages(workload: str) -> list[str]:
    if workload == "json":
        return [INSTRUCTION + t[0] for t in JSON_TEXTS]
    if workload == "regex":
        return REGEX_QUESTIONS
    return [CHOICE_INSTRUCTION + r for r, _ in REVIEWS]


def score(workload: str, texts: list[str]) -> dict:
    """Valid share (the constraint held) and, where there is a truth, the share right."""
    if workload == "json":
        scored = [score_extraction(parse(text), truth) for text, truth in zip(texts, JSON_TEXTS)]
        return {
            "valid": sum(ok for _, ok in scored) / len(texts),
            "right": sum(right for right, _ in scored) / (len(FIELDS) * len(texts)),
        }
    if workload == "regex":
        return {"valid": sum(re.fullmatch(DATE_REGEX, t.strip()) is not None for t in texts) / len(texts)}
    labels = [t.strip() for t in texts]
    return {
        "valid": sum(x in LABELS for x in labels) / len(labels),
        "right": sum(x == want for x, (_, want) in zip(labels, REVIEWS)) / len(labels),
    }


# ------------------------------------------------------------------------------------------- the engines


class PlaitRunner:
    def __init__(self, dtype: str):
        from plait.runtime import Engine

        self.engine = Engine(dtype=dtype)
        self.tokenizer = self.engine.tokenizer

    def params(self, workload: str) -> dict:
        p = {"temperature": 0, "max_new_tokens": MAX_NEW[workload]}
        if workload == "json":
            return {**p, "json_schema": json.dumps(SCHEMA)}
        if workload == "regex":
            return {**p, "regex": DATE_REGEX}
        return {**p, "regex": "(" + "|".join(LABELS) + ")"}

    def generate(self, workload: str, prompts: list[str]) -> list[str]:
        params = [self.params(workload) for _ in prompts]
        self.engine.flush_cache()  # every timed run starts cold, as Outlines' does
        return [o["text"] for o in self.engine.generate(prompts, params)]

    def close(self):
        self.engine.shutdown()


class OutlinesRunner:
    def __init__(self, path: str, dtype: str):
        import outlines
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.model = outlines.from_transformers(hf, self.tokenizer)
        self.generators: dict = {}

    def generator(self, output_type):
        import outlines

        key = json.dumps(output_type) if isinstance(output_type, dict) else str(output_type)
        if key not in self.generators:  # compiled once, as plait's grammar cache keeps them
            self.generators[key] = outlines.Generator(self.model, output_type)
        return self.generators[key]

    def generate(self, workload: str, prompts: list[str]) -> list[str]:
        from typing import Literal

        from outlines.types import JsonSchema, Regex

        kw = {"max_new_tokens": MAX_NEW[workload], "do_sample": False}
        if workload == "json":
            return self.generator(JsonSchema(json.dumps(SCHEMA))).batch(prompts, **kw)
        if workload == "choice":
            return self.generator(Literal[LABELS]).batch(prompts, **kw)
        return self.generator(Regex(DATE_REGEX)).batch(prompts, **kw)

    def close(self):
        pass


def run_engine(engine: str, workloads: list[str], model_path: str, dtype: str) -> dict:
    runner = PlaitRunner(dtype) if engine == "plait" else OutlinesRunner(model_path, dtype)
    result = {}
    for workload in workloads:
        prompts = [
            runner.tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True
            )
            for m in user_messages(workload)
        ]
        runner.generate(workload, prompts[:2])  # warm-up: grammar compiles, kernels
        start = time.perf_counter()
        texts = runner.generate(workload, prompts)
        seconds = time.perf_counter() - start
        result[workload] = {"seconds": seconds, **score(workload, texts), "examples": texts[:2]}
    runner.close()
    return result


def drive(args) -> None:
    """Both engines, alternating, each run a fresh process; the median per workload."""
    from plait.runtime.models.default_model import default_model_path

    model_path = default_model_path()  # the default model as a Hugging Face folder (converted from its GGUF)
    runs: dict = {"plait": [], "outlines": []}
    for _ in range(args.repeats):
        for engine, python in (("plait", sys.executable), ("outlines", args.outlines_python)):
            out = subprocess.run(
                [python, __file__, "--engine", engine, "--model-path", model_path, "--dtype", args.dtype]
                + ["--workloads", *args.workloads],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])},
            )
            if out.returncode != 0:
                raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
            runs[engine].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{engine}: " + ", ".join(f"{w} {runs[engine][-1][w]['seconds']:.2f} s" for w in args.workloads))
    print(f"\n{'workload':<8} {'plait s':>8} {'Outlines s':>10} {'plait x':>8}   valid / right, plait ; Outlines")
    summary = {}
    for w in args.workloads:
        med = {e: statistics.median(r[w]["seconds"] for r in runs[e]) for e in runs}
        last = {e: runs[e][-1][w] for e in runs}

        def quality(x: dict) -> str:
            return f"{x['valid']:.0%}" + (f" / {x['right']:.0%}" if "right" in x else "")

        print(
            f"{w:<8} {med['plait']:>8.2f} {med['outlines']:>10.2f} {med['outlines'] / med['plait']:>7.2f}x"
            f"   {quality(last['plait'])} ; {quality(last['outlines'])}"
        )
        summary[w] = {"median_s": med, "speedup": med["outlines"] / med["plait"], "last": last}
    from bench_common import save

    save(
        f"vs_outlines_{args.dtype}",
        {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "dtype": args.dtype, "workloads": summary},
    )


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("plait", "outlines"), help="run one engine here and print its JSON")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--outlines-python", default="/tmp/ovenv/bin/python", help="a Python with outlines installed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-path", default="", help="with --engine outlines: the Hugging Face folder")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both engines' weights and compute (bfloat16: where the CPU has AVX512-BF16 or AMX)",
    )
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.workloads, args.model_path, args.dtype)))
    else:
        drive(args)


if __name__ == "__main__":
    main()
