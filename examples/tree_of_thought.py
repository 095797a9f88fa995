"""Tree of thought with fork: branches share the question's prefix (prefilled once) and run
concurrently; the model then picks the most promising one.

    python examples/tree_of_thought.py
"""

import plait as sgl

NUM_BRANCHES = 3


@sgl.function
def tree_of_thought(s, question):
    s += "Question: " + question + "\n"
    branches = s.fork(NUM_BRANCHES)
    branches += lambda i: f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=16, stop="\n", temperature=0.8)
    branches.join()
    s += "Ideas:\n" + "".join(f"{i + 1}.{idea}\n" for i, idea in enumerate(s["idea"]))
    s += "The most useful idea is number " + sgl.select("best", [str(i + 1) for i in range(NUM_BRANCHES)])


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    state = tree_of_thought.run(question="How can I sleep better at night?")
    print(state.text())
    cached = [m["cached_tokens"] for m in state.get_meta_info("idea")]
    print(f"\nprefix tokens served from cache per branch: {cached}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
