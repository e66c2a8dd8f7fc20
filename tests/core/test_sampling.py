"""Sampling parameters and the batched sampler."""

from __future__ import annotations

import pytest
import torch

from sgl.engine.sampler import (
    NOISE_BITS,
    SamplingInput,
    sample_next_tokens,
    to_unit_interval,
    uniform_noise,
)
from sgl.sampling import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("data,needle", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": "ten"}, "max_new_tokens"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"frequency_penalty": 5}, "frequency_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"n": 0}, "n"),
    ({"seed": 1.5}, "seed"),
    ({"stop_regex": "(unclosed"}, "stop_regex"),
    ({"stop_regex": [""]}, "stop_regex"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**63 - 2, "n": 3}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"temprature": 0.5}, "temprature"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_sampling_params_name_the_field(data: dict, needle: str) -> None:
    with pytest.raises(SamplingParamsError, match=needle):
        SamplingParams.from_dict(data)


def test_seed_range_edges_accepted() -> None:
    SamplingParams.from_dict({"seed": 2**63 - 3, "n": 3}).validate()
    SamplingParams.from_dict({"seed": -2**63}).validate()


def test_out_of_vocabulary_ids_rejected() -> None:
    params = SamplingParams.from_dict({"stop_token_ids": [5, 999]})
    with pytest.raises(SamplingParamsError, match="999.*vocabulary"):
        params.validate(vocab_size=100)


def test_stop_string_and_logit_bias_normalised() -> None:
    params = SamplingParams.from_dict({"stop": "END", "logit_bias": {"3": -100}})
    assert params.stop == ["END"] and params.logit_bias == {3: -100}


def inputs(params: list[SamplingParams], seeds=None, outputs=None, prompts=None, banned=None):
    n = len(params)
    return SamplingInput(params, seeds or list(range(n)), [0] * n, outputs or [[] for _ in params],
                         prompts or [[] for _ in params], banned or [[] for _ in params])


def test_noise_is_uniform_and_keyed_by_seed_and_step() -> None:
    u = uniform_noise(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 50000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    again = uniform_noise(torch.tensor([3]), torch.tensor([0]), 50000)
    assert torch.equal(u[0], again[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    params = [SamplingParams(temperature=1.0)] * 4000
    got = sample_next_tokens(logits.repeat(4000, 1), inputs(params, seeds=list(range(4000))))
    freq = torch.bincount(got, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_top_k_top_p_min_p_and_greedy() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25]] * 4))
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.1),
              SamplingParams(temperature=1.0, min_p=0.95), SamplingParams(temperature=0.0)]
    for seed in range(50):
        got = sample_next_tokens(logits.clone(), inputs(params, seeds=[seed] * 4))
        assert got.tolist() == [0, 0, 0, 0]


def test_penalties_bias_and_bans() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]] * 4)
    params = [SamplingParams(temperature=0, frequency_penalty=1.0),
              SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(temperature=0, logit_bias={2: 10.0}),
              SamplingParams(temperature=0)]
    got = sample_next_tokens(logits.clone(), inputs(
        params, outputs=[[0], [], [], []], prompts=[[], [0], [], []], banned=[[], [], [], [0]]))
    assert got.tolist() == [1, 1, 2, 1]


def test_noise_never_reaches_zero_or_one_over_its_whole_range() -> None:
    """Every value the noise can take (all 2**23 of them) lies strictly inside (0, 1), so its
    exponential ``-log(u)`` is positive and finite. The 24-bit formula it replaces rounded its
    largest value to exactly 1.0 in float32 (issue 17, item 3)."""
    u = to_unit_interval(torch.arange(1 << NOISE_BITS, dtype=torch.int64))
    assert float(u.min()) > 0 and float(u.max()) < 1
    exponential = -torch.log(u)
    assert bool((exponential > 0).all()) and bool(torch.isfinite(exponential).all())
    assert torch.unique(u).numel() == 1 << NOISE_BITS  # no two bit patterns collide
    old_largest = (torch.tensor(float((1 << 24) - 1)) + 0.5) * (1.0 / (1 << 24))
    assert float(old_largest) == 1.0  # what the old formula gave, and why it was wrong


def test_neighbouring_seeds_draw_unrelated_noise() -> None:
    """``n > 1`` samples run with seeds ``seed + i``; their noise rows used to be the same
    numbers shifted by one token (the counter was ``(seed + token) * constant``)."""
    u = uniform_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 1000)
    assert not torch.isin(u[1], u[0]).any()
    assert abs(float(torch.corrcoef(u)[0, 1])) < 0.1


def test_a_million_sampled_steps_never_leave_the_mask() -> None:
    """2**20 low-temperature draws over a 256-token vocabulary in which only token 7 is
    allowed (a grammar mask: -inf logits): every draw is token 7. Under the old noise about 15
    of these draws picked a masked token through a NaN (21 when measured)."""
    vocab, rows_per_call, calls = 256, 1 << 15, 32
    logits_row = torch.full((vocab,), float("-inf"))
    logits_row[7] = 0.0
    params = [SamplingParams(temperature=0.1)] * rows_per_call
    picked = set()
    for call in range(calls):
        seeds = list(range(call * rows_per_call, (call + 1) * rows_per_call))
        inp = SamplingInput(params, seeds, [call] * rows_per_call, [[]] * rows_per_call,
                            [[]] * rows_per_call, [[]] * rows_per_call)
        picked |= set(sample_next_tokens(logits_row.repeat(rows_per_call, 1), inp).tolist())
    assert picked == {7}


@pytest.mark.parametrize("name,value", [("temperature", 2**63), ("top_k", 10**33),
                                        ("repetition_penalty", 10**20), ("top_p", 1)])
def test_integers_beyond_int64_sample_like_their_meaning(name: str, value: int) -> None:
    """Found by the hostile corpus: ``temperature: 9223372036854775808`` (a JSON integer) or a
    top_k beyond int64 used to fail the sampler ("Overflow when unpacking long long", a 500)."""
    params = SamplingParams.from_dict({name: value, "seed": 3})
    logits = torch.randn(2, 50)
    ids = sample_next_tokens(logits, SamplingInput(
        params=[params, params], seeds=[3, 4], steps=[0, 0], output_ids=[[], []],
        prompt_ids=[[1], [2]], banned=[[], []]))
    assert ids.shape == (2,) and bool(((0 <= ids) & (ids < 50)).all())
