"""`separate_reasoning(gen(...), model_type=...)`: a reasoning model's thinking split from its answer.

After the gen runs, its variable keeps the answer and `<name>_reasoning_content` gets the thinking (SGLang's
names). The state's text keeps both, as the model wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str
    end: str
    # The chat template opens the thinking block in the prompt (DeepSeek-R1): the output starts inside it,
    # with no start marker of its own.
    starts_inside: bool


REASONING_MODELS = {
    "deepseek-r1": ReasoningMarkers("<think>", "</think>", starts_inside=True),
    "deepseek-v3": ReasoningMarkers("<think>", "</think>", starts_inside=False),
    "qwen3": ReasoningMarkers("<think>", "</think>", starts_inside=False),
    "qwen3-thinking": ReasoningMarkers("<think>", "</think>", starts_inside=True),
    "glm45": ReasoningMarkers("<think>", "</think>", starts_inside=False),
    "kimi": ReasoningMarkers("◁think▷", "◁/think▷", starts_inside=False),
}


def reasoning_markers(model_type: Optional[str]) -> ReasoningMarkers:
    """The markers of `model_type` (None: DeepSeek-R1's); ValueError naming the known types otherwise."""
    markers = REASONING_MODELS.get(model_type or "deepseek-r1")
    if markers is None:
        raise ValueError(f"separate_reasoning: unknown model_type {model_type!r}; known: {sorted(REASONING_MODELS)}")
    return markers


def split_reasoning(text: str, markers: ReasoningMarkers) -> tuple[str, str]:
    """(reasoning, answer) of one output. A block never closed is all reasoning (the model ran out of tokens
    while thinking); an output with no block is all answer, unless the prompt opened one."""
    stripped = text.lstrip()
    opened = stripped.startswith(markers.start)
    if opened:
        stripped = stripped[len(markers.start) :]
    elif not markers.starts_inside:
        return "", text
    reasoning, closed, answer = stripped.partition(markers.end)
    if not closed:
        return reasoning.strip(), ""
    return reasoning.strip(), answer.strip()


def reasoning_var_name(name: str) -> str:
    """The variable a separated gen's thinking goes to (SGLang's name)."""
    return f"{name}_reasoning_content"
