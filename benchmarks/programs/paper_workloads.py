"""The SGLang paper's program workloads at its shapes, for paper_programs.py (issue 35).

Nine workloads, each a plait program and a deterministic synthetic batch shaped like the real data set
(SGLang's `benchmark/` folder has a script per workload; these are written from their descriptions):

  mmlu        5-shot: a subject's five worked examples shared by its questions, one answer token
  hellaswag   20-shot: one block of 20 worked contexts shared by every question, select over 4 endings
  tot         tree of thought: 3 plans x 3 executions x 3 reflections, each a gen of 256 tokens
  sot         skeleton of thought: a skeleton of 128 tokens, then 5 points expanded in a fork (256 each)
  judge       LLM judge: an article, fork(6) dimensions (256 each), merged into a summary and a score
  json        JSON decoding: a ~3,000-token document, then five regex-constrained fields
  chat-short  multi-turn chat, 4 turns of short answers (16 tokens)
  chat-long   multi-turn chat, 4 turns of long answers (256 tokens)
  react       ReAct agent: tool descriptions and example runs shared (~1,500 tokens); 4 replayed steps,
              each a thought generated in a fork of one (48 tokens, for the paper's stop at "Observation")
              then the recorded thought, action and observation appended; a last thought
  agents      generative agents: an agent's memory shared by its runs; 4 events, each through the five
              agent functions (gens of 2, 20, 6, 5 tokens and a select over 4 areas): 20 short serial calls

Fixed lengths: every free gen runs with `ignore_eos` and no stop string, so a model with dummy weights
does the same work as a real one (the paper's stop strings, "\\n" or "Observation", are replaced by the
lengths above). Regex fields end where their pattern does. `scale` multiplies the program counts and the
lengths (documents included), for CPU runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import plait as sgl

WORDS = (
    "the a of to and in is for on with as by at from that this it an be are was were has have had not but or "
    "which their they we you he she his her its one two three new old first last many some more most other "
    "time year day way water river city market school system study result group number part place case point "
    "people world house table engine paper model field power light sound color energy value order price road "
    "small large early late long short high low strong simple clear open close right left north south east west "
    "build write read move turn carry hold bring keep find give show take make measure grow change follow begin"
).split()


def text(rng: random.Random, words: int) -> str:
    """`words` words of deterministic filler in sentences of 8-16 words."""
    out, left = [], words
    while left > 0:
        k = min(left, rng.randint(8, 16))
        sentence = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(sentence[0].upper() + sentence[1:] + ".")
        left -= k
    return " ".join(out)


def gen(name: str, tokens: int) -> Any:
    """A free gen of exactly `tokens` tokens (no stop string, EOS ignored)."""
    return sgl.gen(name, max_tokens=tokens, ignore_eos=True)


# ---------------------------------------------------------------- the programs


@sgl.function
def mmlu(s, examples, question):
    s += examples + question + sgl.gen("answer", max_tokens=1)


@sgl.function
def hellaswag(s, shots, context, endings):
    s += shots + context + sgl.select("ending", choices=endings)


@sgl.function
def tree_of_thought(s, question, tokens):
    s += "Solve the problem. Plan, execute each plan, then reflect on each execution.\nQuestion: " + question + "\n"
    plans = s.fork(3)
    plans += lambda i: f"Plan {i + 1}:" + gen("plan", tokens) + "\n"
    executions = [plan.fork(3) for plan in plans]  # breadth first: every plan's branches start together
    for group in executions:
        group += lambda i: f"Execution {i + 1}:" + gen("execution", tokens) + "\n"
    reflections = [branch.fork(3) for group in executions for branch in group]
    for group in reflections:
        group += lambda i: f"Reflection {i + 1}:" + gen("reflection", tokens)
    for group in reflections + executions + [plans]:
        group.join()
    s += "Final answer:" + gen("answer", 8)


@sgl.function
def skeleton_of_thought(s, question, skeleton_tokens, point_tokens):
    s += "Question: " + question + "\nWrite a skeleton of five points, then expand each.\nSkeleton:"
    s += gen("skeleton", skeleton_tokens) + "\n"
    points = s.fork(5)
    points += lambda i: f"Expand point {i + 1}:" + gen("point", point_tokens)
    points.join("concate_and_append")


JUDGE_DIMENSIONS = ("accuracy", "clarity", "depth", "structure", "style", "relevance")


@sgl.function
def llm_judge(s, article, tokens):
    s += "Judge the article below.\n\nArticle: " + article + "\n\n"
    forks = s.fork(len(JUDGE_DIMENSIONS))
    forks += lambda i: f"Judge its {JUDGE_DIMENSIONS[i]}:" + gen("judgement", tokens)
    forks.join()
    for dimension, branch in zip(JUDGE_DIMENSIONS, forks):
        s += f"\n{dimension}: " + branch["judgement"]
    s += "\n\nSummary:" + gen("summary", tokens // 2)
    s += "\nScore (1-9): " + sgl.gen("score", regex="[1-9]", max_tokens=16)


JSON_FIELDS = (
    ("invoice", r"INV-[0-9]{6}"),
    ("date", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"),
    ("amount", r"[0-9]{4}\.[0-9]{2}"),
    ("city", r"[A-Z][a-z]{2,11}"),
    ("code", r"[A-Z]{3}-[0-9]{4}"),
)


# Regex fields get budgets well past their patterns' lengths: near a tight budget the runtime's budget closer
# searches for a completion at every step, a CPU cost the field itself does not need.
@sgl.function
def json_decode(s, document):
    s += document + "\n\nThe record above as JSON:\n{"
    for i, (field, pattern) in enumerate(JSON_FIELDS):
        s += f'"{field}": "' + sgl.gen(field, regex=pattern, max_tokens=64) + '"' + (", " if i < 4 else "}")


@sgl.function
def chat(s, system, turns, tokens):
    s += system + "\n\n"
    for i, turn in enumerate(turns):
        s += "User: " + turn + "\nAssistant:" + gen(f"answer{i}", tokens) + "\n"


@sgl.function
def react(s, header, question, steps, tokens):
    """A replayed run: each step's thought is generated in a fork of one and thrown away (a benchmark of
    the calls, not an agent), then the recorded thought, action and observation are appended."""
    s += header + "Question: " + question + "\n"
    for k, step in enumerate(steps):
        s += f"Thought {k + 1}:"
        branch = s.fork(1)
        branch[0] += gen("thought_action", tokens)
        branch.join()
        s += step + "\n"
    s += f"Thought {len(steps) + 1}:" + gen("final", tokens)


AGENT_AREAS = [" kitchen}", " garden}", " library}", " cafe}"]
AGENT_TASKS = (  # the five agent functions that make most of the paper's calls: (instruction, tokens)
    ("Rate the poignancy of the event from 1 to 10:", 2),
    ("The event as (subject, predicate, object): (", 20),
    ("The event as at most two emojis:", 6),
    ("The area to go to next: {", 0),  # a select over AGENT_AREAS
    ("The object to use there: {", 5),
)


@sgl.function
def generative_agent(s, memory, events, scale):
    s += memory
    for k, event in enumerate(events):
        s += "\nEvent: " + event
        for j, (instruction, tokens) in enumerate(AGENT_TASKS):
            s += "\n" + instruction
            if tokens:
                s += gen(f"call{k}_{j}", max(1, round(tokens * scale)))
            else:
                s += sgl.select(f"call{k}_{j}", choices=AGENT_AREAS)


# ---------------------------------------------------------------- batches


def mmlu_batch(rng: random.Random, subjects: int, per_subject: int, words: int) -> list[dict]:
    """Questions of about `words` words with four options; each subject's 5 examples are shared."""

    def item() -> tuple[str, str]:
        gold = rng.randrange(4)
        options = "".join(f"{'ABCD'[k]}. {text(rng, 6)}\n" for k in range(4))
        return f"Question: {text(rng, words)}\n{options}Answer:", "ABCD"[gold]

    batch = []
    for subject in range(subjects):
        shots = [item() for _ in range(5)]
        examples = f"The following are multiple choice questions about subject {subject}.\n\n"
        examples += "".join(q + " " + a + "\n\n" for q, a in shots)
        for _ in range(per_subject):
            question, gold = item()
            batch.append({"examples": examples, "question": question, "_gold": gold})
    return batch


def hellaswag_batch(rng: random.Random, count: int, words: int) -> list[dict]:
    shots = "".join(text(rng, words) + " " + text(rng, words // 2) + "\n\n" for _ in range(20))
    batch = []
    for _ in range(count):
        endings = [" " + text(rng, max(2, words // 2)) for _ in range(4)]
        batch.append({"shots": shots, "context": text(rng, words), "endings": endings, "_gold": endings[0]})
    return batch


def json_batch(rng: random.Random, count: int, words: int) -> list[dict]:
    cities = ["Lisbon", "Oslo", "Valencia", "Hamburg", "Osaka", "Lagos", "Sofia", "Dublin"]
    batch = []
    for _ in range(count):
        gold = {
            "invoice": f"INV-{rng.randrange(10**6):06d}",
            "date": f"20{rng.randrange(10, 30)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
            "amount": f"{rng.randrange(1000, 10000)}.{rng.randrange(100):02d}",
            "city": rng.choice(cities),
            "code": "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(3)) + f"-{rng.randrange(10**4):04d}",
        }
        facts = [
            f"The invoice number is {gold['invoice']}.",
            f"It was issued on {gold['date']}.",
            f"The amount due is {gold['amount']} euros.",
            f"The goods ship from {gold['city']}.",
            f"The customs code is {gold['code']}.",
        ]
        parts = [text(rng, words // 6) for _ in range(6)]
        document = " ".join(p + " " + f for p, f in zip(parts, facts)) + " " + parts[5]
        batch.append({"document": document, "_gold": gold})
    return batch


def react_header(rng: random.Random, words: int) -> str:
    tools = "".join(f"Tool {name}: {text(rng, words // 6)}\n" for name in ("search", "lookup", "calculate", "finish"))
    examples = "".join(
        f"Example {k + 1}: " + text(rng, words // 6) + "\nThought 1: " + text(rng, words // 12) + "\n\n"
        for k in range(2)
    )
    return "Answer by thinking in steps and using the tools.\n" + tools + "\n" + examples


# ---------------------------------------------------------------- the registry


@dataclass
class Workload:
    name: str
    program: Any
    batch: list[dict]  # arguments, plus "_gold" where the workload has answers (not passed to the program)
    accuracy: Optional[Callable[[Any, Any], float]] = None  # (state, gold) -> share right

    def arguments(self) -> list[dict]:
        return [{k: v for k, v in item.items() if not k.startswith("_")} for item in self.batch]

    def score(self, states: list[Any]) -> Optional[float]:
        if self.accuracy is None:
            return None
        right = [
            0.0 if s.error() is not None else self.accuracy(s, item["_gold"]) for s, item in zip(states, self.batch)
        ]
        return sum(right) / max(1, len(right))


def json_accuracy(state: Any, gold: dict) -> float:
    return sum(state[field] == gold[field] for field, _ in JSON_FIELDS) / len(JSON_FIELDS)


NAMES = ("mmlu", "hellaswag", "tot", "sot", "judge", "json", "chat-short", "chat-long", "react", "agents")


def all_workloads(scale: float = 1.0, seed: int = 35, length_scale: Optional[float] = None) -> list[Workload]:
    """The workloads at `scale` (program counts; lengths too unless `length_scale` is given). 1.0: the
    paper's lengths, counts sized for one GPU machine."""

    def n(count: int) -> int:  # programs
        return max(2, round(count * scale))

    def t(tokens: int) -> int:  # tokens or words
        return max(2, round(tokens * (scale if length_scale is None else length_scale)))

    rng = random.Random(seed)
    # The tool header and agent memories are shared across programs, as in the paper's data.
    header = react_header(rng, t(1200))
    memories = [f"You are agent {a}. Your memory:\n" + text(rng, t(600)) + "\n" for a in range(8)]
    chat_system = "You are a helpful assistant. " + text(rng, t(100))
    return [
        Workload(
            "mmlu",
            mmlu,
            mmlu_batch(rng, n(8), n(32), t(60)),
            lambda s, gold: float(s["answer"].strip()[:1] == gold),
        ),
        Workload(
            "hellaswag", hellaswag, hellaswag_batch(rng, n(256), t(30)), lambda s, gold: float(s["ending"] == gold)
        ),
        Workload("tot", tree_of_thought, [{"question": text(rng, t(60)), "tokens": t(256)} for _ in range(n(8))]),
        Workload(
            "sot",
            skeleton_of_thought,
            [{"question": text(rng, t(40)), "skeleton_tokens": t(128), "point_tokens": t(256)} for _ in range(n(32))],
        ),
        Workload("judge", llm_judge, [{"article": text(rng, t(700)), "tokens": t(256)} for _ in range(n(32))]),
        Workload("json", json_decode, json_batch(rng, n(64), t(2300)), json_accuracy),
        Workload(
            "chat-short",
            chat,
            [
                {"system": chat_system, "turns": [text(rng, t(50)) for _ in range(4)], "tokens": t(16)}
                for _ in range(n(64))
            ],
        ),
        Workload(
            "chat-long",
            chat,
            [
                {"system": chat_system, "turns": [text(rng, t(50)) for _ in range(4)], "tokens": t(256)}
                for _ in range(n(32))
            ],
        ),
        Workload(
            "react",
            react,
            [
                {
                    "header": header,
                    "question": text(rng, t(30)),
                    "steps": [text(rng, t(60)) for _ in range(4)],
                    "tokens": t(48),
                }
                for _ in range(n(64))
            ],
        ),
        Workload(
            "agents",
            generative_agent,
            [
                {
                    "memory": memories[i % 8],
                    "events": [text(rng, t(20)) for _ in range(4)],
                    "scale": min(1.0, scale if length_scale is None else length_scale),
                }
                for i in range(n(64))
            ],
        ),
    ]
