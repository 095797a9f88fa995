"""Multi-turn chat: roles as functions and as `with` blocks; `messages()` in OpenAI's format.

.venv/bin/python examples/multi_turn_chat.py   (or python, with .venv activated)
"""

import plait as sgl


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant. Keep answers short.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32))
    with s.user():
        s += question_2
    with s.assistant():
        s += sgl.gen("answer_2", max_tokens=32)


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    state = multi_turn_question.run(
        question_1="What is the capital of the United Kingdom?",
        question_2="Name one famous landmark there.",
        temperature=0,
    )
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    print("\nThe prompt the model saw, in its own chat template:\n")
    print(state.text())
    runtime.shutdown()


if __name__ == "__main__":
    main()
