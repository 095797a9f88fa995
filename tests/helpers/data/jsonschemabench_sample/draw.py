"""Draws this folder's sample from the project's JSONSchemaBench subset (../shared/data/jsonschemabench):
per category, in file order, the first PER_CATEGORY schemas whose JSON text is at most MAX_CHARS long and
that the xgrammar backend accepts; each record keeps its id, category and schema (the instances are left out).

    python tests/helpers/data/jsonschemabench_sample/draw.py /work/shared/data/jsonschemabench
"""

from __future__ import annotations

import json
import os
import sys

from plait.runtime.constrained import validate_constraint

PER_CATEGORY = 2
MAX_CHARS = 1500


def main(source: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    records = []
    for fname in sorted(os.listdir(source)):
        if not fname.endswith(".jsonl"):
            continue
        taken = 0
        with open(os.path.join(source, fname)) as f:
            for line in f:
                rec = json.loads(line)
                text = json.dumps(rec["schema"], separators=(",", ":"))
                if len(text) > MAX_CHARS:
                    continue
                try:
                    validate_constraint("json", text)
                except ValueError:
                    continue
                records.append({"id": rec["id"], "category": rec["category"], "schema": rec["schema"]})
                taken += 1
                if taken == PER_CATEGORY:
                    break
    with open(os.path.join(here, "sample.jsonl"), "w") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    print(f"{len(records)} schemas")


if __name__ == "__main__":
    main(sys.argv[1])
