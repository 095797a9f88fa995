"""Tree of thought with fork: branches share the question's prefix (prefilled once) and run
concurrently; the model then picks the most promising one.

    .venv/bin/python examples/tree_of_thought.py   (or python, with .venv activated)
"""

import plait as sgl

NUM_BRANCHES = 3


@sgl.function
def tree_of_thought(s, question):
    s += sgl.user(question + " Give one practical idea in one sentence.")
    branches = s.fork(NUM_BRANCHES)  # the conversation so far is prefilled once, then shared
    branches += sgl.assistant(sgl.gen("idea", max_tokens=16, stop="\n", temperature=0.7))
    branches.join()  # s["idea"] is now the list of the branches' ideas
    ideas = "".join(f"{i + 1}. {idea.strip()}\n" for i, idea in enumerate(s["idea"]))
    s += sgl.user("Here are some ideas:\n" + ideas + "Which one is the most useful? Answer with its number.")
    s += sgl.assistant(sgl.select("best", [str(i + 1) for i in range(NUM_BRANCHES)]))


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    state = tree_of_thought.run(question="How can I sleep better at night?")
    for i, idea in enumerate(state["idea"]):
        print(f"branch {i + 1}: {idea.strip()}")
    print(f"the model picks idea {state['best']}")
    cached = [m["cached_tokens"] for m in state.get_meta_info("idea")]
    print(f"\nprefix tokens served from cache per branch: {cached}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
