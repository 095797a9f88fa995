"""How `select` picks among choices from the logprobs the runtime returns.

Every method receives, per choice, the logprobs of the choice's tokens given the prompt
(`input_token_logprobs[i]` is a list of `(logprob, token_id, text)`) and the mean of those
(`normalized_prompt_logprobs[i]`), and returns the decision plus the scores it used, which land in
`state.get_meta_info(name)`. Ties go to the earliest choice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence

Logprobs = Sequence[Sequence[Any]]  # per choice: [(logprob, token_id, text|None), ...]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[dict[str, Any]] = None


def _argmax_first(values: Sequence[float]) -> int:
    if not values:
        raise ValueError("select() needs at least one choice")
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        """True if the backend must also score each choice with no prompt at all."""
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Logprobs,
        output_token_logprobs: Logprobs,
        unconditional_token_logprobs: Optional[Logprobs] = None,
    ) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return type(self).__name__


def _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs) -> dict:
    return {
        "normalized_prompt_logprobs": list(normalized_prompt_logprobs),
        "input_token_logprobs": input_token_logprobs,
        "output_token_logprobs": output_token_logprobs,
    }


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Highest mean token logprob: long choices are not punished for their length."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best], _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Decide token by token, as greedy decoding would: keep the choices whose token at position j
    has the highest logprob, until one is left. A choice shorter than the others is padded with
    its own mean logprob, so "Paris" can still beat "Paris, France" when it is better on average."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        width = max(len(option) for option in input_token_logprobs)
        matrix = []  # (num_choices, width)
        for option in input_token_logprobs:
            row = [tok[0] for tok in option]
            matrix.append(row + [_mean(row)] * (width - len(row)))
        alive = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == best]
            if len(alive) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[alive[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Highest mean of log p(token | prompt) - log p(token | no prompt): discounts choices that are
    likely whatever the question (common words) in favour of what the prompt makes likely.
    The first unconditional logprob has no context and comes back as None; it counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError(
                    f"conditional ({len(cond)}) and unconditional ({len(uncond)}) logprobs differ in length"
                )
            diffs = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond)]
            scores.append(_mean(diffs))
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_argmax_first(scores)], meta)


class CustomChoicesMethod(ChoicesSamplingMethod):
    """A choice method written for SGLang: any callable taking the keywords above and returning a decision
    (an object with `.decision` and `.meta_info`), with an optional `requires_unconditional_logprobs`."""

    def __init__(self, method: Any) -> None:
        self.method = method
        # NOTE: read once: SGLang's protocol makes the attribute optional (False when absent).
        self._unconditional = bool(getattr(method, "requires_unconditional_logprobs", False))

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return self._unconditional

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        return self.method(
            choices=choices,
            normalized_prompt_logprobs=normalized_prompt_logprobs,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
        )

    def __repr__(self) -> str:
        return repr(self.method)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
