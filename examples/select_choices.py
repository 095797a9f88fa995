"""select: the model picks among fixed choices, scored by likelihood in one batched request.

Each line prints the choice and both choices' mean token logprobs. The embedded 135M model leans to
"positive" for every review (the negative one only narrows the gap, about -0.7 against -1.8): this
shows how select works, not a good classifier. The choice is always one of `choices`.

(Not named select.py: a script of that name would shadow the standard library module `select`.)

    .venv/bin/python examples/select_choices.py   (or python, with .venv activated)
"""

import plait as sgl


@sgl.function
def classify(s, review):
    s += sgl.user("Is this review positive or negative?\nReview: " + review)
    s += sgl.assistant("The review is " + sgl.select("sentiment", choices=["positive", "negative"]))


REVIEWS = [
    "I loved it, the best pizza in town!",
    "Cold food, rude staff, never again.",
    "Wonderful service and a great view.",
]


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    for review in REVIEWS:
        state = classify.run(review=review)
        scores = state.get_meta_info("sentiment")["normalized_prompt_logprobs"]
        print(f"{state['sentiment']:>8}  (mean logprob positive {scores[0]:.2f}, negative {scores[1]:.2f})  {review}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
