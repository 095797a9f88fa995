"""Validity over real-world schemas: what share of outputs a user can parse and validate.

JSONSchemaBench (--schema-dir, else ../shared/data/jsonschemabench when it is beside the repo, else the
in-repo sample tests/helpers/data/jsonschemabench_sample), the first --per-category schemas of each category,
prompt "Produce a JSON object that follows this schema: <schema>", greedy, the default model, all requests of a
run in one batch.
Two settings, back to back in one engine:

- before: json_style "compact" and close_within_budget off (the outputs as they were: compact JSON, cut
  wherever the budget ran out; what did not change with them is in RESULTS.md);
- after: the defaults (natural JSON, closing within the budget, loops cut short).

and two budgets: the issue's 384 tokens, and a tight one (each schema's smallest valid value + 12 tokens).
Per run, as shares of all the schemas taken: valid (parses and validates, formats checked), invalid but
reported (every violated keyword is in meta_info.grammar_warnings), unparsed, invalid (not reported), closed
early (the engine's grammar_closed_early count: steered to a shortest completion by the budget or a loop),
refused (the runtime did not accept the schema); mean output tokens, wall seconds.

    python benchmarks/grammar/bench_grammar.py --parts validity --per-category 3 --num-threads 1
"""

from __future__ import annotations

import json
import os
import re
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FULL_SET = os.path.join(HERE, "..", "..", "..", "shared", "data", "jsonschemabench")
SAMPLE = os.path.join(HERE, "..", "..", "tests", "helpers", "data", "jsonschemabench_sample", "sample.jsonl")
SETTINGS = {"before": {"json_style": "compact", "close_within_budget": False}, "after": {}}
SLACK = 12
PROMPT_CHARS = 4000


def load_schemas(per_category: int, max_chars: int, schema_dir: str = "") -> tuple[str, list[dict]]:
    """(where they came from, records with id, category, schema)."""
    folder = schema_dir or FULL_SET
    if os.path.isdir(folder):
        records = []
        for fname in sorted(os.listdir(folder)):
            if fname.endswith(".jsonl"):
                with open(os.path.join(folder, fname)) as f:
                    rows = [json.loads(line) for line in f]
                records += [r for r in rows if len(json.dumps(r["schema"])) <= max_chars][:per_category]
        return f"jsonschemabench ({os.path.abspath(folder)})", records
    with open(SAMPLE) as f:
        rows = [json.loads(line) for line in f]
    by_cat: dict = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    return "jsonschemabench_sample (in repo)", [r for cat in by_cat.values() for r in cat[:per_category]]


def accepted_schemas(records: list[dict], tokenizer) -> tuple[list[dict], int]:
    """The records the runtime accepts (intake check and compile), each with its smallest value's length."""
    from plait.runtime.constrained import create_grammar_backend, validate_constraint
    from plait.runtime.constrained.completion import CompletionSearch
    from plait.runtime.constrained.json_scan import JsonScanner
    from plait.runtime.constrained.token_tables import TokenTables

    backend = create_grammar_backend("xgrammar", tokenizer, num_threads=1, compile_timeout=60)
    search = CompletionSearch(TokenTables(backend.vocab))
    kept, refused = [], 0
    for rec in records:
        text = json.dumps(rec["schema"])
        try:
            validate_constraint("json_natural", text)
            compiled = backend.get_or_compile(("json_natural", text)).result()
        except ValueError:
            refused += 1
            continue
        smallest = search.find(compiled.new_matcher(), JsonScanner())
        kept.append({**rec, "smallest": len(smallest.token_ids) if smallest is not None else 64})
    backend.shutdown()
    return kept, refused


def check(out: dict, schema: dict) -> str:
    """valid | reported (invalid, the keyword reported) | invalid | unparsed | refused."""
    import jsonschema

    meta = out["meta_info"]
    if meta["finish_reason"]["type"] == "abort":
        return "refused"
    try:
        value = json.loads(out["text"])
    except json.JSONDecodeError:
        return "unparsed"
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    errors = list(validator.iter_errors(value))
    if not errors:
        return "valid"
    reported = {m.group(1) for w in meta.get("grammar_warnings", []) for m in re.finditer(r"'(\w+)'", w)}
    named = all(reported & ({e.validator} | {p for p in e.schema_path if isinstance(p, str)}) for e in errors)
    return "reported" if named else "invalid"


def part_validity(per_category: int, max_chars: int, num_threads: int, schema_dir: str = "") -> dict:
    from plait.runtime import Engine

    source, records = load_schemas(per_category, max_chars, schema_dir)
    result: dict = {"source": source, "schemas": len(records), "num_threads": num_threads, "runs": {}}
    with Engine(num_threads=num_threads, max_total_tokens=65536) as eng:
        kept, refused = accepted_schemas(records, eng.tokenizer)
        result["refused"] = refused
        prompts = [
            eng.tokenizer.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": "Produce a JSON object that follows this schema: "
                        + json.dumps(r["schema"])[:PROMPT_CHARS],
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            )
            for r in kept
        ]
        eng.generate(prompts[0], {"max_new_tokens": 2})  # warm-up
        for budget_name in ("384", "tight"):
            for label, setting in SETTINGS.items():
                params = [
                    {
                        "temperature": 0,
                        "json_schema": json.dumps(r["schema"]),
                        **setting,
                        "max_new_tokens": 384 if budget_name == "384" else r["smallest"] + SLACK,
                    }
                    for r in kept
                ]
                eng.flush_cache()
                closed_before = eng.get_stats().get("grammar_closed_early", 0)
                start = time.perf_counter()
                outs = eng.generate(prompts, params)
                secs = time.perf_counter() - start
                if label == "before" and budget_name == "384":
                    outs_before_384 = outs
                closed = eng.get_stats().get("grammar_closed_early", 0) - closed_before
                verdicts = [check(o, r["schema"]) for o, r in zip(outs, kept)]
                total = len(records)
                result["runs"][f"{label}/{budget_name}"] = {
                    "valid_pct": round(100 * verdicts.count("valid") / total, 1),
                    "reported_pct": round(100 * verdicts.count("reported") / total, 1),
                    "unparsed_pct": round(100 * verdicts.count("unparsed") / total, 1),
                    "invalid_pct": round(100 * verdicts.count("invalid") / total, 1),
                    "closed_early_pct": round(100 * closed / total, 1),
                    "refused_pct": round(100 * (refused + verdicts.count("refused")) / total, 1),
                    "mean_output_tokens": round(sum(o["meta_info"]["completion_tokens"] for o in outs) / len(outs), 1),
                    "seconds": round(secs, 1),
                    "failures": [
                        (r["id"], v, o["text"][:160]) for r, v, o in zip(kept, verdicts, outs) if v not in ("valid",)
                    ],
                }
        stats = eng.get_stats()
        result["engine_stats"] = {k: v for k, v in stats.items() if k.startswith(("grammar", "completion"))}
        cut_texts = [(r, o["text"]) for r, o in zip(kept, outs_before_384)]
        result["completion_paths"] = completion_paths(cut_texts, eng.tokenizer)
    return result


def completion_paths(cut_texts: list[tuple[dict, str]], tokenizer) -> dict:
    """The two ways to the shortest completion, measured on the same states (the before/384 outputs cut at
    a quarter, half and three quarters of their tokens): the JSON closers alone (close the string and the
    containers, schema-free; no search) and the search over the grammar matcher. How often each finds a
    valid completion, how long it takes, how many tokens it writes."""
    from plait.runtime.constrained import create_grammar_backend
    from plait.runtime.constrained.completion import CompletionSearch
    from plait.runtime.constrained.json_scan import JsonScanner
    from plait.runtime.constrained.token_tables import TokenTables

    backend = create_grammar_backend("xgrammar", tokenizer, num_threads=1, compile_timeout=60)
    search = CompletionSearch(TokenTables(backend.vocab))
    out = {
        "states": 0,
        "closers_valid": 0,
        "closers_us": [],
        "closers_tokens": [],
        "search_valid": 0,
        "search_us": [],
        "search_tokens": [],
        "search_nodes": [],
    }
    for rec, text in cut_texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        compiled = backend.get_or_compile(("json_natural", json.dumps(rec["schema"]))).result()
        for frac in (0.25, 0.5, 0.75):
            matcher, scanner = compiled.new_matcher(), JsonScanner()
            cut = ids[: max(1, int(len(ids) * frac))]
            if not all(matcher.accept_token(t) for t in cut) or matcher.is_completed():
                continue
            scanner.feed(b"".join(backend.vocab.decoded[t] for t in cut))
            out["states"] += 1
            start = time.perf_counter()
            closers = scanner.closing_text()
            found = search.verify(matcher, closers, "closers", scanner) if closers else None
            out["closers_us"].append(1e6 * (time.perf_counter() - start))
            if found is not None:
                out["closers_valid"] += 1
                out["closers_tokens"].append(len(found.token_ids))
            start = time.perf_counter()
            found = search.search_only(matcher, None if scanner.broken else scanner)
            out["search_us"].append(1e6 * (time.perf_counter() - start))
            if found is not None:
                out["search_valid"] += 1
                out["search_tokens"].append(len(found.token_ids))
                out["search_nodes"].append(found.nodes)
    backend.shutdown()

    def mean(values):
        return round(sum(values) / len(values), 1) if values else None

    return {
        "states": out["states"],
        "closers_valid": out["closers_valid"],
        "closers_mean_us": mean(out["closers_us"]),
        "closers_mean_tokens": mean(out["closers_tokens"]),
        "search_valid": out["search_valid"],
        "search_mean_us": mean(out["search_us"]),
        "search_p90_us": sorted(out["search_us"])[int(0.9 * len(out["search_us"]))] if out["search_us"] else None,
        "search_mean_tokens": mean(out["search_tokens"]),
        "search_mean_nodes": mean(out["search_nodes"]),
    }


def print_table(result: dict) -> None:
    print(f"{result['source']}: {result['schemas']} schemas, num_threads={result['num_threads']}")
    print("completion paths:", result.get("completion_paths"))
    print("engine:", result.get("engine_stats"))
    print(
        f"{'run':<14} {'valid':>6} {'reported':>9} {'unparsed':>9} {'invalid':>8} {'closed early':>13} "
        f"{'refused':>8} {'mean out tok':>13} {'s':>7}"
    )
    for name, r in result["runs"].items():
        print(
            f"{name:<14} {r['valid_pct']:>5}% {r['reported_pct']:>8}% {r['unparsed_pct']:>8}% {r['invalid_pct']:>7}% "
            f"{r['closed_early_pct']:>12}% {r['refused_pct']:>7}% {r['mean_output_tokens']:>13} {r['seconds']:>7}"
        )
