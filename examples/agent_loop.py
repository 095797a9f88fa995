"""An agent loop: the model chooses an action, Python runs the tool, the program branches on it.

.venv/bin/python examples/agent_loop.py   (or python, with .venv activated)
"""

import ast
import operator

import plait as sgl

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """A safe arithmetic evaluator: the tool the model can call."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")

    expression = expression.split("=")[0].strip()  # small models often write "17 * 23 = <guess>"
    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


@sgl.function
def agent(s, question, max_steps=3):
    s += sgl.system(
        "You are a math assistant. Write an arithmetic expression for the calculator; when the "
        "result answers the question, say so."
    )
    s += sgl.user(question)
    for _ in range(max_steps):
        s += sgl.assistant("Expression: " + sgl.gen("expression", max_tokens=16, stop="\n"))
        result = calculator(s["expression"])  # the tool: plain Python, between model calls
        s += sgl.user(f"The calculator says {result}. Is that the final answer? Say yes or no.")
        s += sgl.assistant(sgl.select("done", choices=["yes", "no"]))
        if s["done"] == "yes":  # reading s[...] waits for the model; then Python branches
            break
    s += sgl.user("State the final answer in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, stop="\n"))


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    state = agent.run(question="A box holds 17 rows of 23 apples. How many apples?", temperature=0)
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
