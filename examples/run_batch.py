"""run_batch over a small dataset: programs run concurrently on one runtime (continuous batching,
shared few-shot prefix cached once); results come back in input order.

    .venv/bin/python examples/run_batch.py   (or python, with .venv activated)
"""

import time

import plait as sgl

FEW_SHOT = (
    "Classify each animal as mammal, bird or fish, then give a short fact about it.\n\n"
    "Animal: dog\nClass: mammal\nFact: Dogs can hear sounds four times farther away than people.\n\n"
    "Animal: eagle\nClass: bird\nFact: Eagles can spot a rabbit from three kilometres away.\n\n"
    "Animal: salmon\nClass: fish\nFact: Salmon swim back to the river where they hatched.\n\n"
)

DATASET = ["cat", "sparrow", "tuna", "horse", "penguin", "shark", "whale", "owl"]


@sgl.function
def classify(s, animal):
    s += FEW_SHOT + "Animal: " + animal + "\nClass: "
    s += sgl.select("label", choices=["mammal", "bird", "fish"])
    s += "\nFact:" + sgl.gen("fact", max_tokens=12, stop="\n")


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    started = time.perf_counter()
    states = classify.run_batch([{"animal": a} for a in DATASET], progress_bar=True, temperature=0)
    elapsed = time.perf_counter() - started
    for animal, state in zip(DATASET, states):
        if state.error() is not None:
            print(f"{animal:>8}: failed: {state.error()}")
            continue
        print(f"{animal:>8}: {state['label']:<6} | {state['fact'].strip()}")
    tokens = sum(s.get_meta_info("fact")["completion_tokens"] for s in states if s.error() is None)
    print(f"\n{len(DATASET)} programs in {elapsed:.1f}s ({tokens / elapsed:.1f} generated tokens/s)")
    runtime.shutdown()


if __name__ == "__main__":
    main()
