"""An agent loop: the model chooses an action, Python runs the tool, the program branches on it.

    python examples/agent_loop.py
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

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


@sgl.function
def agent(s, question, expression, max_steps=3):
    s += sgl.system("You solve problems. You may use a calculator before answering.")
    s += sgl.user(question)
    for step in range(max_steps):
        s += sgl.assistant("Action: " + sgl.select("action", choices=["calculator", "answer"]))
        if s["action"] == "answer":
            break
        result = calculator(expression)  # plain Python, between model calls
        s += sgl.user(f"calculator({expression}) = {result}. Now answer.")
        expression = expression  # the tool input could itself be generated with sgl.gen
    s += sgl.assistant("Answer: " + sgl.gen("answer", max_tokens=24, stop="\n"))


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    state = agent.run(question="A box holds 17 rows of 23 apples. How many apples?", expression="17 * 23",
                      temperature=0)
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
