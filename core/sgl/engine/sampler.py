"""The batched sampler: penalties, logit bias, temperature, top-k/top-p/min-p, seeded draws.

Everything is vectorised over the batch; nothing loops over the vocabulary in Python. Random
draws use a counter-based generator keyed by ``(seed, step)``: a request's ``n``-th token is
drawn from the same numbers whatever else is in the batch, which makes seeded sampling
reproducible and keeps it unchanged across retraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl.kernels.cpu import argmax_rows
from sgl.sampling import SamplingParams

__all__ = ["NOISE_BITS", "SamplingInput", "apply_token_bitmask", "sample_next_tokens",
           "to_unit_interval", "uniform_noise"]

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_STEP = _signed(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


#: random bits per noise value. With 23, ``(k + 0.5) / 2**23`` is exact in float32 for every
#: k, so the noise is never 0 or 1. (With 24 the largest k rounded to exactly 1.0, whose
#: exponential ``-log(1)`` is -0.0: every zero probability became 0/-0 = NaN, which ``max``
#: picks, so a masked or filtered token could be sampled.)
NOISE_BITS = 23


def to_unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """Integers in ``[0, 2**NOISE_BITS)`` -> float32 numbers strictly inside (0, 1)."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << NOISE_BITS))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[batch, vocab]`` numbers strictly inside (0, 1), a pure function of
    ``(seed, step, token)``: splitmix64 over a counter that starts at a hash of
    ``(seed, step)``, so rows of neighbouring seeds (``n > 1`` samples use ``seed + i``) are
    unrelated rather than shifted copies of one another."""
    row = _mix(seeds * _GOLDEN + steps * _STEP)
    tokens = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = row[:, None] + tokens[None, :] * _GOLDEN
    return to_unit_interval(_shr(_mix(x), 64 - NOISE_BITS))


_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf the logits of tokens a grammar forbids, for the rows ``rows`` of ``logits``
    ``[batch, vocab]``; ``bitmask[j]`` (int32, ``ceil(vocab / 32)`` words) is the mask of row
    ``rows[j]``, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (the layout of
    xgrammar, llguidance and outlines-core). Tokens past the bitmask's width are forbidden."""
    vocab, device = logits.shape[-1], logits.device
    bitmask = bitmask.to(device)  # the packed words travel, not a bool per token
    allowed = ((bitmask[:, :, None] >> _BITS.to(device)) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(list(rows), dtype=torch.int64, device=device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, index, sub)


@dataclass
class SamplingInput:
    """Per-row facts the sampler needs besides the logits."""

    params: Sequence[SamplingParams]
    seeds: Sequence[int]  # every request has one (drawn at arrival when the client gave none)
    steps: Sequence[int]  # index of the token being drawn (0 for the first output token)
    output_ids: Sequence[Sequence[int]]  # for penalties
    prompt_ids: Sequence[Sequence[int]]  # for the repetition penalty
    banned: Sequence[Sequence[int]]  # token ids forbidden this step (EOS before min_new_tokens)


def _apply_penalties(logits: torch.Tensor, inp: SamplingInput) -> None:
    batch, vocab = logits.shape
    rows = [i for i, p in enumerate(inp.params) if p.needs_penalties]
    if not rows:
        return
    device = logits.device
    longest = max(1, max(len(inp.output_ids[i]) for i in rows))
    out = torch.full((len(rows), longest), vocab, dtype=torch.int64)
    for j, i in enumerate(rows):
        ids = inp.output_ids[i]
        if ids:
            out[j, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.float32))
    counts = counts[:, :vocab].to(device)
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    sub = logits.index_select(0, index)
    freq = torch.tensor([inp.params[i].frequency_penalty for i in rows], device=device)
    pres = torch.tensor([inp.params[i].presence_penalty for i in rows], device=device)
    sub -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
    if any(inp.params[i].repetition_penalty != 1.0 for i in rows):
        rep = torch.tensor([inp.params[i].repetition_penalty for i in rows], device=device)
        seen = counts > 0
        for j, i in enumerate(rows):  # mark prompt tokens too (one scatter per row, not per token)
            if inp.prompt_ids[i]:
                seen[j].index_fill_(0, torch.tensor(inp.prompt_ids[i], device=device), True)
        factor = torch.where(sub > 0, 1.0 / rep[:, None], rep[:, None])
        sub = torch.where(seen, sub * factor, sub)
    logits.index_copy_(0, index, sub)


def _apply_bias_and_bans(logits: torch.Tensor, inp: SamplingInput) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(inp.params):
        for token, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(token)
            vals.append(float(bias))
        for token in inp.banned[i]:
            rows.append(i)
            cols.append(token)
            vals.append(float("-inf"))
    if rows:
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.tensor(vals, dtype=logits.dtype, device=device),
                          accumulate=True)


def sample_next_tokens(logits: torch.Tensor, inp: SamplingInput) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[batch, vocab]`` (float32, modified in place).

    :return: ``[batch]`` int64 token ids.
    """
    _apply_penalties(logits, inp)
    _apply_bias_and_bans(logits, inp)
    params = inp.params
    greedy_ids = argmax_rows(logits)  # argmax(-1), several times faster on CPU
    if all(p.greedy for p in params):
        return greedy_ids
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                         device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    # decided from the parameters on the host: no device round trip
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = (ranks >= top_k[:, None]) | (before > top_p[:, None])
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values,
                                  0.0)
    seeds = torch.tensor(list(inp.seeds), dtype=torch.int64, device=device)
    steps = torch.tensor(list(inp.steps), dtype=torch.int64, device=device)
    exponential = -torch.log(uniform_noise(seeds, steps, vocab))
    sampled = (probs / exponential).max(dim=-1).indices  # exponential race: a draw from probs
    is_greedy = torch.tensor([p.greedy for p in params], device=device)
    return torch.where(is_greedy, greedy_ids, sampled)
