"""`sglang.lang.choices`: plait's select() choice methods under SGLang's module path."""

from plait.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

__all__ = [
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "greedy_token_selection",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
]
