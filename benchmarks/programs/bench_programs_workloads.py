"""The programs and data of bench_programs.py: SGLang's frontend benchmark workloads, scaled for a CPU.

Each workload runs its programs with `run_batch` (greedy) on the backend it is given and returns the
states; `output_of(state)` is what is compared across modes. The data is synthetic but shaped like
the real benchmarks (few-shot blocks shared by groups of questions, tool descriptions shared by agent
runs, ...), and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import plait as sgl

# ---------------------------------------------------------------- 5-shot MMLU-style

MMLU_HEADER = "The following are multiple choice questions (with answers).\n\n"


def mmlu_question(q: str, options: list[str]) -> str:
    return "Question: " + q + "\n" + "".join(f"{'ABCD'[i]}. {o}\n" for i, o in enumerate(options)) + "Answer:"


def mmlu_subjects() -> dict[str, list[tuple[str, list[str], str]]]:
    """Four synthetic subjects of 21 questions each (5 examples + 16 questions), answers rotating A-D."""
    pairs = [(a, b) for a in range(2, 9) for b in range(3, 6)]  # 21 pairs

    def rotate(correct: str, wrong: list[str], i: int) -> tuple[list[str], str]:
        k = i % 4
        options = wrong[:k] + [correct] + wrong[k:3]
        return options, "ABCD"[k]

    subjects: dict[str, list] = {"addition": [], "multiplication": [], "comparison": [], "geography": []}
    for i, (a, b) in enumerate(pairs):
        options, letter = rotate(str(a + b), [str(a + b + 1), str(a + b - 2), str(a * b + 1)], i)
        subjects["addition"].append((f"What is {a} + {b}?", options, letter))
        options, letter = rotate(str(a * b), [str(a * b + a), str(a + b), str(a * b - 1)], i)
        subjects["multiplication"].append((f"What is {a} times {b}?", options, letter))
        nums = [a * 7 % 19, b * 11 % 23 + 20, a + b, 3 * a]
        options, letter = rotate(str(max(nums)), [str(x) for x in nums if x != max(nums)][:3] + ["0"] * 3, i)
        subjects["comparison"].append((f"Which is the largest of {', '.join(map(str, nums))}?", options, letter))
    capitals = [
        ("France", "Paris"),
        ("Italy", "Rome"),
        ("Spain", "Madrid"),
        ("Germany", "Berlin"),
        ("Japan", "Tokyo"),
        ("Egypt", "Cairo"),
        ("Peru", "Lima"),
        ("Kenya", "Nairobi"),
        ("Canada", "Ottawa"),
        ("Chile", "Santiago"),
        ("Norway", "Oslo"),
        ("Greece", "Athens"),
        ("India", "New Delhi"),
        ("Cuba", "Havana"),
        ("Poland", "Warsaw"),
        ("Ireland", "Dublin"),
        ("Austria", "Vienna"),
        ("Sweden", "Stockholm"),
        ("Portugal", "Lisbon"),
        ("Russia", "Moscow"),
        ("Mexico", "Mexico City"),
    ]
    for i, (country, capital) in enumerate(capitals):
        wrong = [c for _, c in capitals if c != capital][i % 7 : i % 7 + 3]
        options, letter = rotate(capital, wrong, i)
        subjects["geography"].append((f"What is the capital of {country}?", options, letter))
    return subjects


@sgl.function
def few_shot_mmlu(s, examples, question):
    s += examples + question + sgl.gen("answer", max_tokens=1)


def mmlu_batch(per_subject: int) -> list[dict]:
    batch = []
    for items in mmlu_subjects().values():
        examples = MMLU_HEADER + "".join(mmlu_question(q, o) + " " + a + "\n\n" for q, o, a in items[:5])
        batch += [{"examples": examples, "question": mmlu_question(q, o)} for q, o, _ in items[5 : 5 + per_subject]]
    return batch


# ---------------------------------------------------------------- HellaSwag-style select

HELLASWAG_SHOTS = (
    "A man is standing on a ladder next to a house. He climbs to the roof and starts removing old shingles. "
    "He then nails new shingles in place.\n\n"
    "A woman pours flour and sugar into a bowl. She cracks two eggs over the bowl and whisks everything "
    "together. She pours the batter into a pan.\n\n"
)
HELLASWAG_ITEMS = [
    (
        "A boy kicks a ball across the park. His dog runs after it and",
        ["brings it back to him.", "starts to sing.", "reads a newspaper.", "turns into a cat."],
    ),
    (
        "A chef slices onions on a cutting board. She adds them to a hot pan and",
        ["stirs them with a spoon.", "throws the pan out the window.", "paints the ceiling.", "falls asleep."],
    ),
    (
        "A cyclist reaches the top of a steep hill. He stops, drinks some water and",
        ["rides down the other side.", "plants a tree.", "swims across the road.", "opens an umbrella indoors."],
    ),
    (
        "A girl opens her school bag and takes out a notebook. She picks up a pencil and",
        ["starts writing her homework.", "eats the pencil.", "flies to the moon.", "feeds it to the fish."],
    ),
    (
        "A man fills a watering can at the tap. He walks into the garden and",
        ["waters the flowers.", "builds a car.", "sings to the moon.", "fries an egg."],
    ),
    (
        "Two friends set up a chess board on a table. They sit down and",
        ["start the first game.", "climb a mountain.", "wash the dishes.", "drive to the beach."],
    ),
    (
        "A woman puts on her running shoes. She opens the door and",
        ["jogs down the street.", "cooks a turkey.", "plays the piano.", "paints the dog."],
    ),
    (
        "A mechanic opens the hood of a car. He looks at the engine and",
        ["checks the oil level.", "plants tomatoes.", "writes a poem.", "takes a bath."],
    ),
]


@sgl.function
def few_shot_hellaswag(s, context, endings):
    s += HELLASWAG_SHOTS + context
    s += sgl.select("ending", choices=[" " + e for e in endings])


# ---------------------------------------------------------------- tree of thought (nested forks)


@sgl.function
def tree_of_thought(s, question):
    s += sgl.system("You solve problems step by step.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    plans = s.fork(2)
    plans += lambda i: f"Approach {i + 1}:" + sgl.gen("plan", max_tokens=8, stop="\n") + "\n"
    for plan in plans:
        steps = plan.fork(2)
        steps += lambda i: f"Step {i + 1}:" + sgl.gen("step", max_tokens=8, stop="\n")
        steps.join()
    plans.join()
    s += "Final answer:" + sgl.gen("answer", max_tokens=8, stop="\n")
    s += sgl.assistant_end()


TOT_QUESTIONS = [
    "How many legs do three cats and two birds have in total?",
    "A train leaves at 3 pm and travels 2 hours. When does it arrive?",
    "If a shirt costs 20 dollars and is 25 percent off, what is its price?",
    "What is the sum of the first five odd numbers?",
]


# ---------------------------------------------------------------- skeleton of thought (fork/join)


@sgl.function
def skeleton_of_thought(s, question):
    s += "Question: " + question + "\n"
    s += "Give a skeleton of three short points.\nSkeleton:" + sgl.gen("skeleton", max_tokens=16, stop="\n\n")
    s += "\nNow expand each point.\n"
    points = s.fork(3)
    points += lambda i: f"Point {i + 1} in one sentence:" + sgl.gen("point", max_tokens=12, stop="\n")
    points.join("concate_and_append")
    s += "\nSummary:" + sgl.gen("summary", max_tokens=8, stop="\n")


SOT_QUESTIONS = [
    "How can I sleep better?",
    "How do I start learning to cook?",
    "How do I save money each month?",
    "How can a small team work well together?",
]


# ---------------------------------------------------------------- 4-turn chat

CHAT_SYSTEM = (
    "You are a friendly travel assistant. Keep every answer to one short sentence, suggest "
    "concrete places, and never ask more than one question back."
)


@sgl.function
def four_turn_chat(s, turns):
    s += sgl.system(CHAT_SYSTEM)
    for i, turn in enumerate(turns):
        s += sgl.user(turn)
        s += sgl.assistant(sgl.gen(f"answer{i}", max_tokens=8))


CHAT_CONVERSATIONS = [
    ["I want to visit Italy.", "Which city first?", "What food should I try there?", "Any day trip nearby?"],
    ["I like mountains.", "Where in Europe?", "When is the best season?", "What should I pack?"],
    ["I have a weekend in Paris.", "What museum?", "Where to eat cheaply?", "Is the metro easy?"],
    ["I want a beach holiday.", "Somewhere warm in winter?", "Is it family friendly?", "How do I get there?"],
    [
        "I am going to Japan in spring.",
        "Where are the best cherry blossoms?",
        "How do I travel between cities?",
        "What souvenir should I bring home?",
    ],
    ["I want to see the northern lights.", "Which country is best?", "What month should I go?", "What should I wear?"],
    [
        "I have three days in London.",
        "What should I see first?",
        "Where can I find good food?",
        "Is a day trip to Oxford worth it?",
    ],
    ["I like hiking and wine.", "Which region fits that?", "Where should I stay?", "How long should I stay?"],
]


# ---------------------------------------------------------------- JSON extraction

PASSAGES = [
    "Maria Lopez, 34, is a nurse who lives in Valencia and has two cats.",
    "Tom Becker is a 52 year old carpenter from Hamburg who builds boats.",
    "Aiko Tanaka, aged 27, works as a software engineer in Osaka.",
    "Samuel Okafor, a 41 year old teacher, lives in Lagos with his family.",
    "Elena Petrova is 63 and runs a bakery in Sofia.",
    "Liam Walsh, 19, studies physics in Dublin.",
]
JSON_INSTRUCTIONS = (
    "Extract the person's name, city, job and age from the passage as JSON with the keys name, city, job and age.\n\n"
)


def extract_json_program(use_regex: bool):
    @sgl.function
    def extract_json(s, passage):
        age = sgl.gen("age", regex=r"[0-9]{1,3}") if use_regex else sgl.gen("age", max_tokens=3, stop=[",", "}", "\n"])
        s += JSON_INSTRUCTIONS + "Passage: " + passage + "\nJSON: "
        with s.var_scope("json"):
            s += '{"name": "' + sgl.gen("name", max_tokens=8, stop='"') + '", '
            s += '"city": "' + sgl.gen("city", max_tokens=6, stop='"') + '", '
            s += '"job": "' + sgl.gen("job", max_tokens=6, stop='"') + '", '
            s += '"age": ' + age + "}"

    return extract_json


# ---------------------------------------------------------------- ReAct agent loop

REACT_SYSTEM = (
    "Answer the question by thinking step by step and using tools.\n"
    "Tools:\n"
    "calculator: evaluates an arithmetic expression, e.g. 3 * (4 + 5).\n"
    "lookup: returns a short fact about a country or city.\n"
    "finish: gives the final answer.\n"
    "Format each step as Thought, then Action (one tool), then Input.\n\n"
)
FACTS = {
    "france": "France's capital is Paris; population about 68 million.",
    "japan": "Japan's capital is Tokyo; population about 124 million.",
    "paris": "Paris is on the Seine and has about 2 million inhabitants.",
}


def run_tool(action: str, tool_input: str) -> str:
    if action == "calculator":
        allowed = set("0123456789+-*/(). ")
        expr = "".join(ch for ch in tool_input if ch in allowed).strip()
        try:
            return str(eval(expr, {"__builtins__": {}}, {})) if expr else "no expression"  # noqa: S307 -- digits/ops only
        except Exception:
            return "error"
    words = tool_input.lower()
    return next((fact for key, fact in FACTS.items() if key in words), "no fact found")


@sgl.function
def react_agent(s, question, max_steps=3):
    s += REACT_SYSTEM + "Question: " + question + "\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought{step}", max_tokens=12, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action{step}", choices=["calculator", "lookup", "finish"]) + "\n"
        if s[f"action{step}"] == "finish":
            break
        s += "Input:" + sgl.gen(f"input{step}", max_tokens=8, stop="\n") + "\n"
        s += "Observation: " + run_tool(s[f"action{step}"], s[f"input{step}"]) + "\n"
    s += "Answer:" + sgl.gen("answer", max_tokens=8, stop="\n")


REACT_QUESTIONS = [
    "How many people live in France and Japan together?",
    "What is 17 times 23?",
    "Which river flows through Paris?",
    "What is 144 divided by 12?",
    "What is the capital of Japan and how many people live there?",
    "What is 3 * (4 + 5)?",
]


# ---------------------------------------------------------------- the registry


@dataclass
class Workload:
    name: str
    batch: Callable[[], list[dict]]
    program: Callable[["Workload"], Any]
    output: Callable[[Any], str]
    use_regex: bool = False

    def run(self, runtime: Any) -> list[Any]:
        return self.program(self).run_batch(self.batch(), temperature=0, backend=runtime)

    def output_of(self, state: Any) -> str:
        return "<error>" if state.error() is not None else self.output(state)


def regex_supported(runtime: Any) -> bool:
    """Whether the runtime decodes regex-constrained gens (runtime/constrained)."""
    try:
        out = runtime.generate("Age: ", {"max_new_tokens": 4, "temperature": 0, "regex": "[0-9]{1,3}"})
    except Exception:
        return False
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    return reason.get("type") != "abort" and out["text"].isdigit()


def all_workloads(scale: float = 1.0) -> list[Workload]:
    def n(base: int, cap: int) -> int:
        return max(1, min(cap, round(base * scale)))

    return [
        Workload("mmlu", lambda: mmlu_batch(n(8, 16)), lambda w: few_shot_mmlu, lambda s: s["answer"]),
        Workload(
            "hellaswag",
            lambda: [{"context": c, "endings": e} for c, e in HELLASWAG_ITEMS[: n(8, 8)]],
            lambda w: few_shot_hellaswag,
            lambda s: s["ending"],
        ),
        Workload(
            "tot",
            lambda: [{"question": q} for q in TOT_QUESTIONS[: n(4, 4)]],
            lambda w: tree_of_thought,
            lambda s: s.text(),
        ),
        Workload(
            "sot",
            lambda: [{"question": q} for q in SOT_QUESTIONS[: n(4, 4)]],
            lambda w: skeleton_of_thought,
            lambda s: s.text(),
        ),
        Workload(
            "chat",
            lambda: [{"turns": t} for t in CHAT_CONVERSATIONS[: n(8, 8)]],
            lambda w: four_turn_chat,
            lambda s: s.text(),
        ),
        Workload(
            "json",
            lambda: [{"passage": p} for p in PASSAGES[: n(6, 6)]],
            lambda w: extract_json_program(w.use_regex),
            lambda s: s["json"],
        ),
        Workload(
            "react",
            lambda: [{"question": q} for q in REACT_QUESTIONS[: n(6, 6)]],
            lambda w: react_agent,
            lambda s: s.text(),
        ),
    ]
