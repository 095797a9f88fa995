"""A ReAct agent: Thought / Action / Observation steps, with Python tools run between model calls.

    .venv/bin/python examples/react_agent.py        (the embedded SmolLM2-135M on the CPU; 10-40 s)

Each step the model writes a Thought (`gen`, stopped at the end of the line), picks an Action among
the tool names (`select`: always exactly one of them), and writes the tool's input; then plain Python
runs the tool and the program appends its Observation. When the model picks "finish", or after
MAX_STEPS, the Final Answer is generated under a regex, so it always has the promised shape.

What it shows:
- one program calling another: `s += react_header(TOOLS)` runs the few-shot header on the caller's
  state, so every question starts with the same text and run_batch prefills it once;
- reading `s["action_0"]` inside the program waits for the model, then Python branches on it (and
  Python decides which actions the model may choose at each step);
- `run_batch` over several questions, `state.get_meta_info(...)` for the tokens the prefix cache saved.

A 135M model is a weak agent: expect odd thoughts; the structure (choices, stops, regex) always holds.
"""

import ast
import operator
import re

import plait as sgl

MAX_STEPS = 3
FINAL_ANSWER = r"[0-9]+|[A-Z][a-z]+"  # a number, or one capitalised word
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
FACTS = {"france": "Paris", "italy": "Rome", "spain": "Madrid", "germany": "Berlin"}


def calculator(expression: str) -> str:
    """Arithmetic on numbers and + - * / only (never eval: the input is model output)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * / are allowed")

    expression = expression.split("=")[0].strip()  # small models write "12 * 7 = <a guess>"
    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else round(result, 4))


def capital_of(country: str) -> str:
    return FACTS.get(country.strip().strip(".").lower(), "unknown country")


TOOLS = {"calculator": calculator, "capital_of": capital_of}
ACTIONS = [*TOOLS, "finish"]


@sgl.function
def react_header(s, tools):
    s += (
        "Answer the question step by step. Each step has a Thought, an Action (one of "
        + ", ".join(tools)
        + ", finish) and an Action Input; the tool's result comes back as the "
        "Observation. Choose finish once the Observation answers the question.\n\n"
        "Question: What is 3 + 4?\n"
        "Thought: I need to add the numbers.\nAction: calculator\nAction Input: 3 + 4\nObservation: 7\n"
        "Thought: The observation answers the question.\nAction: finish\nFinal Answer: 7\n\n"
    )


@sgl.function
def react(s, question):
    s += react_header(list(TOOLS))
    s += "Question: " + question + "\n"
    for step in range(MAX_STEPS):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=20, stop="\n") + "\n"
        # The first step must use a tool: a tiny model would rather "finish" at once and guess.
        choices = ACTIONS if step > 0 else list(TOOLS)
        s += "Action: " + sgl.select(f"action_{step}", choices=choices) + "\n"
        action = s[f"action_{step}"]  # waits for the model; then plain Python decides
        if action == "finish":
            break
        s += "Action Input: " + sgl.gen(f"input_{step}", max_tokens=12, stop="\n") + "\n"
        s += "Observation: " + TOOLS[action](s[f"input_{step}"]) + "\n"
    s += "Final Answer: " + sgl.gen("answer", max_tokens=6, regex=FINAL_ANSWER)


def check(state) -> None:
    """What the program promised, whatever the model wrote."""
    for step in range(MAX_STEPS):
        if f"action_{step}" in state:
            assert state[f"action_{step}"] in ACTIONS
    assert re.fullmatch(FINAL_ANSWER, state["answer"]), state["answer"]


def main() -> None:
    runtime = sgl.Runtime(num_threads=1)  # one torch thread: faster on a busy CPU
    sgl.set_default_backend(runtime)
    questions = ["What is 12 * 7?", "What is the capital of Italy?", "What is 100 - 58?"]
    states = react.run_batch([{"question": q} for q in questions], temperature=0, num_threads=3)
    for question, state in zip(questions, states):
        if state.error() is not None:
            print(f"{question}: failed: {state.error()!r}")
            continue
        check(state)
        print(state.text()[state.text().index("Question: " + question) :])
        meta = state.get_meta_info("answer")
        print(
            f"[final answer: {state['answer']!r}; its prompt: {meta['prompt_tokens']} tokens, "
            f"{meta['cached_tokens']} from the prefix cache]\n"
        )
    runtime.shutdown()


if __name__ == "__main__":
    main()
