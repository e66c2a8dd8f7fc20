"""How ``select`` picks among its choices, from the log probabilities of each choice's tokens.

A method gets, for every choice, the logprobs of its tokens given the prompt (and, for the
unconditional method, given nothing) and returns a :class:`ChoicesDecision`. The three methods
are those SGLang offers under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChoicesDecision", "ChoicesMethod", "greedy_token_selection",
           "token_length_normalized", "unconditional_likelihood_normalized"]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesMethod:
    """Base of the scoring methods; ``requires_unconditional`` asks the backend for the
    choices' logprobs without the prompt as well."""

    requires_unconditional = False

    def __call__(self, choices: list[str], token_logprobs: list[list[float]],
                 unconditional_logprobs: list[list[float]] | None = None) -> ChoicesDecision:
        raise NotImplementedError


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


class TokenLengthNormalized(ChoicesMethod):
    """The choice with the highest mean logprob per token (the default)."""

    def __call__(self, choices, token_logprobs, unconditional_logprobs=None):
        scores = [_mean(lps) for lps in token_logprobs]
        best = max(range(len(choices)), key=lambda i: scores[i])
        return ChoicesDecision(choices[best], {"normalized_prompt_logprobs": scores,
                                               "input_token_logprobs": token_logprobs})


class GreedyTokenSelection(ChoicesMethod):
    """Walk the choices token by token, keeping only those whose token at each position has the
    highest logprob, until one is left (ties of equal tokens go on; among choices that end
    first, the first wins)."""

    def __call__(self, choices, token_logprobs, unconditional_logprobs=None):
        alive = list(range(len(choices)))
        position = 0
        while len(alive) > 1:
            present = [i for i in alive if position < len(token_logprobs[i])]
            if not present:
                break
            best = max(token_logprobs[i][position] for i in present)
            alive = [i for i in present if token_logprobs[i][position] == best]
            position += 1
        return ChoicesDecision(choices[alive[0]], {
            "normalized_prompt_logprobs": [_mean(lps) for lps in token_logprobs],
            "input_token_logprobs": token_logprobs})


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The choice whose mean logprob per token gains most from the prompt: mean conditional
    logprob minus mean unconditional logprob (the choice's tokens scored alone)."""

    requires_unconditional = True

    def __call__(self, choices, token_logprobs, unconditional_logprobs=None):
        if unconditional_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional "
                             "logprobs of the choices")
        scores = [_mean(c) - (_mean(u) if u else 0.0)
                  for c, u in zip(token_logprobs, unconditional_logprobs)]
        best = max(range(len(choices)), key=lambda i: scores[i])
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": [_mean(lps) for lps in token_logprobs],
            "unconditional_scores": scores, "input_token_logprobs": token_logprobs,
            "unconditional_token_logprobs": unconditional_logprobs})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
