"""Field extraction in each JSON style: does the constraint keep the model on its own way of writing JSON?

24 short texts about people and companies; the model fills a 5-field schema (a string name, an enum kind, a
bounded integer age_or_founded, a city, a role_or_industry), greedy, default model, all requests in one batch.
Styles: `unconstrained` (no grammar; the first {...} of the text parsed afterwards), `compact` ("," and ":"),
`natural` (", " and ": ", the default), `indent` (two spaces a level). Reported per style: schema-valid share,
fields right (name, city and role_or_industry compared case- and punctuation-insensitively, kind and
age_or_founded exactly), wall time (best of --repeats, the styles interleaved so that machine load hits them
alike), output tokens, and the work that does not depend on the machine's load: decode steps and the forced
tokens jump-forward appended.

    python benchmarks/grammar/bench_extraction.py --num-threads 1

Prints a table and writes JSON to benchmarks/out/bench_extraction.json ($OUT on the device machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["person", "company"]},
        "age_or_founded": {"type": "integer", "minimum": 0, "maximum": 2100},
        "city": {"type": "string"},
        "role_or_industry": {"type": "string"},
    },
    "required": ["name", "kind", "age_or_founded", "city", "role_or_industry"],
}
INSTRUCTION = (
    "Extract these fields from the text as a JSON object: name; kind (person or company); "
    "age_or_founded (the person's age, or the year the company was founded); city; role_or_industry "
    "(the person's job, or the company's industry).\n\nText: "
)
# (text, name, kind, age_or_founded, city, role_or_industry)
TEXTS = [
    ("Maria Lopez, 34, is a nurse who lives in Valencia.", "Maria Lopez", "person", 34, "Valencia", "nurse"),
    ("Tom Becker is a 52 year old carpenter from Hamburg.", "Tom Becker", "person", 52, "Hamburg", "carpenter"),
    ("Aiko Tanaka, aged 27, works as a pilot in Osaka.", "Aiko Tanaka", "person", 27, "Osaka", "pilot"),
    ("Samuel Okafor, a 41 year old teacher, lives in Lagos.", "Samuel Okafor", "person", 41, "Lagos", "teacher"),
    ("Elena Petrova is 63 and works as a baker in Sofia.", "Elena Petrova", "person", 63, "Sofia", "baker"),
    ("Liam Walsh, 19, is a student in Dublin.", "Liam Walsh", "person", 19, "Dublin", "student"),
    ("Priya Nair, 45, practises as a dentist in Chennai.", "Priya Nair", "person", 45, "Chennai", "dentist"),
    ("Jonas Berg is a 38 year old architect based in Oslo.", "Jonas Berg", "person", 38, "Oslo", "architect"),
    ("Fatima Zahra, 29, is a journalist in Casablanca.", "Fatima Zahra", "person", 29, "Casablanca", "journalist"),
    (
        "Carlos Mendes, aged 56, drives a taxi in Lisbon as a taxi driver.",
        "Carlos Mendes",
        "person",
        56,
        "Lisbon",
        "taxi driver",
    ),
    ("Grace Kim, 33, is a software engineer in Seoul.", "Grace Kim", "person", 33, "Seoul", "software engineer"),
    ("Pierre Dubois is a 70 year old farmer near Lyon.", "Pierre Dubois", "person", 70, "Lyon", "farmer"),
    (
        "Nordwind Energy was founded in 1998 in Bremen and builds wind turbines; it is in the energy industry.",
        "Nordwind Energy",
        "company",
        1998,
        "Bremen",
        "energy",
    ),
    (
        "Blue Harbor Foods, a seafood company, was founded in 1972 in Halifax.",
        "Blue Harbor Foods",
        "company",
        1972,
        "Halifax",
        "seafood",
    ),
    (
        "Quantis Labs is a biotech company started in 2011 in Basel.",
        "Quantis Labs",
        "company",
        2011,
        "Basel",
        "biotech",
    ),
    (
        "Sakura Motors, founded in 1954 in Nagoya, makes cars for the automotive industry.",
        "Sakura Motors",
        "company",
        1954,
        "Nagoya",
        "automotive",
    ),
    (
        "Pampa Textiles has been weaving cloth in Rosario since it was founded in 1936; it is a textiles firm.",
        "Pampa Textiles",
        "company",
        1936,
        "Rosario",
        "textiles",
    ),
    (
        "Kestrel Software, founded in 2005, is a software company from Austin.",
        "Kestrel Software",
        "company",
        2005,
        "Austin",
        "software",
    ),
    (
        "Atlas Freight is a logistics company founded in 1989 in Rotterdam.",
        "Atlas Freight",
        "company",
        1989,
        "Rotterdam",
        "logistics",
    ),
    ("Verde Bank, founded in 1921 in Milan, works in banking.", "Verde Bank", "company", 1921, "Milan", "banking"),
    (
        "Lumen Studios is an animation company set up in 2016 in Montreal.",
        "Lumen Studios",
        "company",
        2016,
        "Montreal",
        "animation",
    ),
    (
        "Savanna Telecom was founded in 2001 in Nairobi and works in telecommunications.",
        "Savanna Telecom",
        "company",
        2001,
        "Nairobi",
        "telecommunications",
    ),
    (
        "Highland Brewing, a brewery founded in 1994, is based in Edinburgh.",
        "Highland Brewing",
        "company",
        1994,
        "Edinburgh",
        "brewery",
    ),
    (
        "Orion Aerospace, founded in 1967 in Toulouse, is in the aerospace industry.",
        "Orion Aerospace",
        "company",
        1967,
        "Toulouse",
        "aerospace",
    ),
]
FIELDS = ("name", "kind", "age_or_founded", "city", "role_or_industry")
STYLES = ("unconstrained", "compact", "natural", "indent")


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": INSTRUCTION + text}], tokenize=False, add_generation_prompt=True
    )


def params(style: str, max_new: int) -> dict:
    base = {"temperature": 0, "max_new_tokens": max_new}
    if style == "unconstrained":
        return base
    return {**base, "json_schema": json.dumps(SCHEMA), "json_style": style}


def parse(text: str):
    """The first JSON object in the text (unconstrained output may wrap it in prose or a code fence)."""
    start = text.find("{")
    while start != -1:
        try:
            value, _ = json.JSONDecoder().raw_decode(text[start:])
            if isinstance(value, dict):
                return value
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    return None


def norm(value) -> str:
    return re.sub(r"[^a-z0-9 ]", "", str(value).lower()).strip()


def score(value, truth: tuple) -> tuple[int, bool]:
    """(fields right, schema-valid) for one output."""
    import jsonschema

    if not isinstance(value, dict):
        return 0, False
    right = 0
    for field, expected in zip(FIELDS, truth[1:]):
        got = value.get(field)
        if field in ("kind", "age_or_founded"):
            right += got == expected and type(got) is type(expected)
        else:
            right += norm(got) == norm(expected)
    try:
        jsonschema.validate(value, SCHEMA)
        valid = True
    except jsonschema.ValidationError:
        valid = False
    return right, valid


def run(num_threads: int, max_new: int, repeats: int) -> dict:
    from plait.runtime import Engine

    result: dict = {}
    with Engine(num_threads=num_threads) as eng:
        prompts = [chat(eng.tokenizer, t[0]) for t in TEXTS]
        eng.generate(prompts[0], params("natural", 4))  # warm-up: model and grammar backend
        for _ in range(repeats):
            for style in STYLES:
                eng.flush_cache()
                before = eng.get_stats()
                start = time.perf_counter()
                outs = eng.generate(prompts, [params(style, max_new)] * len(prompts))
                secs = time.perf_counter() - start
                after = eng.get_stats()
                entry = result.setdefault(style, {"runs_s": []})
                # Load-independent work: decode steps (model-sampled tokens of the batch) and forced tokens
                # appended by jump-forward.
                entry["decode_steps"] = after["steps"]["decode"]["steps"] - before["steps"]["decode"]["steps"]
                entry["jump_forward_tokens"] = after.get("jump_forward_tokens", 0) - before.get(
                    "jump_forward_tokens", 0
                )
                entry["runs_s"].append(round(secs, 2))
                scored = [score(parse(o["text"]), t) for o, t in zip(outs, TEXTS)]
                entry["fields_right"] = round(sum(r for r, _ in scored) / (len(FIELDS) * len(TEXTS)), 4)
                entry["schema_valid"] = round(sum(v for _, v in scored) / len(TEXTS), 4)
                entry["output_tokens"] = sum(o["meta_info"]["completion_tokens"] for o in outs)
                entry["examples"] = [o["text"] for o in outs[:2]] + [outs[12]["text"]]
        stats = eng.get_stats()
    for entry in result.values():
        entry["best_s"] = min(entry["runs_s"])
    # How the closing spent its time over all the runs (it acts only near a budget's end).
    result["engine_stats"] = {k: v for k, v in stats.items() if k.startswith(("grammar", "completion"))}
    return result


def print_table(result: dict) -> None:
    print(
        f"{'style':<14} {'fields right':>12} {'valid':>6} {'best s':>7} {'out tokens':>10} {'decode steps':>12} "
        f"{'jumped tokens':>13}"
    )
    for style in STYLES:
        e = result[style]
        print(
            f"{style:<14} {e['fields_right']:>12.1%} {e['schema_valid']:>6.0%} {e['best_s']:>7.2f} "
            f"{e['output_tokens']:>10} {e['decode_steps']:>12} {e['jump_forward_tokens']:>13}"
        )
    print("closing:", result.get("engine_stats"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    result = run(args.num_threads, args.max_new_tokens, args.repeats)
    print_table(result)
    save("bench_extraction", {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "styles": result})


if __name__ == "__main__":
    main()
