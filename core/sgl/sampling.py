"""Sampling parameters of a request and the batched sampler."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingParams", "SamplingParamsError", "sample"]


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown or out of range; the message names it."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Names follow SGLang's ``sampling_params``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        data = dict(data or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; supported: "
                f"{', '.join(known)}")
        params = cls(**{k: v for k, v in data.items() if v is not None})
        params.validate()
        return params

    def validate(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SamplingParamsError(f"{name} must be {what}, got {getattr(self, name)!r}")

        need(isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
             and self.max_new_tokens >= 0, "max_new_tokens", "an integer >= 0")
        need(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
             "temperature", "a number >= 0")
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
             "top_p", "a number in (0, 1]")
        need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             "top_k", "-1 (off) or an integer >= 1")
        need(isinstance(self.stop_token_ids, list)
             and all(isinstance(t, int) for t in self.stop_token_ids),
             "stop_token_ids", "a list of integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


def sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[batch, vocab]``; returns ``[batch]`` int64."""
    import torch

    greedy_ids = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_ids
    device = logits.device
    temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=device)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params],
                          device=device)
    top_ps = torch.tensor([p.top_p for p in params], device=device)
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=device)[None, :]
    cumulative = sorted_probs.cumsum(dim=-1)
    drop = (ranks >= top_ks[:, None]) | ((cumulative - sorted_probs) > top_ps[:, None])
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    choice = torch.multinomial(sorted_probs, num_samples=1).squeeze(-1)
    sampled = sorted_idx.gather(-1, choice[:, None]).squeeze(-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=device)
    return torch.where(is_greedy, greedy_ids, sampled)
