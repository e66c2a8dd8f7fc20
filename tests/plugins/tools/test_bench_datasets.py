"""sgl bench's prompt generators: lengths, seeds, the shared-prefix structure, ShareGPT files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sgl_bench.datasets import (
    BenchError,
    generated_shared_prefix,
    load_sharegpt,
    random_requests,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sgl.model_loader import load_tokenizer

    return load_tokenizer(None)  # the bundled SmolLM2's


def test_random_ids_have_exact_lengths_and_no_special_tokens(tokenizer: Any) -> None:
    reqs = random_requests(tokenizer, num_prompts=20, input_len=64, output_len=16, seed=0)
    assert len(reqs) == 20
    special = set(tokenizer.all_special_ids)
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 64
        assert r.output_len == 16
        assert not special & set(r.prompt)
        assert all(0 <= t < len(tokenizer) for t in r.prompt)


def test_random_length_ranges(tokenizer: Any) -> None:
    reqs = random_requests(tokenizer, num_prompts=200, input_len=40, output_len=10,
                           range_ratio=0.5, seed=1)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 40 and len(set(ins)) > 10
    assert min(outs) >= 5 and max(outs) <= 10 and len(set(outs)) > 3
    assert all(len(r.prompt) == r.prompt_len for r in reqs)


def test_random_is_seeded(tokenizer: Any) -> None:
    def make(seed: int) -> list[Any]:
        return random_requests(tokenizer, num_prompts=5, input_len=16, output_len=4,
                               range_ratio=0.2, seed=seed)

    assert make(7) == make(7)
    assert make(7) != make(8)


def test_random_text_is_retokenized_to_its_length(tokenizer: Any) -> None:
    reqs = random_requests(tokenizer, num_prompts=10, input_len=48, output_len=8, seed=2,
                           as_text=True)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert abs(r.prompt_len - 48) <= 4


def test_generated_shared_prefix_structure(tokenizer: Any) -> None:
    reqs = generated_shared_prefix(tokenizer, num_groups=3, prompts_per_group=4,
                                   system_prompt_len=24, question_len=6, output_len=5, seed=0)
    assert len(reqs) == 12
    assert all(len(r.prompt) == r.prompt_len == 30 and r.output_len == 5 for r in reqs)
    groups = Counter(tuple(r.prompt[:24]) for r in reqs)
    assert sorted(groups.values()) == [4, 4, 4]  # 3 system prompts, 4 questions each
    assert len({tuple(r.prompt[24:]) for r in reqs}) == 12  # every question differs
    # shuffled: the groups arrive interleaved, not one after the other
    order = [tuple(r.prompt[:24]) for r in reqs]
    assert any(order[i] != order[i + 1] for i in range(3))
    assert reqs == generated_shared_prefix(tokenizer, num_groups=3, prompts_per_group=4,
                                           system_prompt_len=24, question_len=6, output_len=5,
                                           seed=0)


def test_generated_shared_prefix_as_text(tokenizer: Any) -> None:
    reqs = generated_shared_prefix(tokenizer, num_groups=2, prompts_per_group=3,
                                   system_prompt_len=20, question_len=5, output_len=4, seed=0,
                                   as_text=True)
    assert sorted(Counter(r.system for r in reqs).values()) == [3, 3]
    for r in reqs:
        assert r.text == r.system + r.prompt
        assert r.prompt_len == len(tokenizer.encode(r.text, add_special_tokens=False))


def test_bad_lengths_are_refused(tokenizer: Any) -> None:
    with pytest.raises(BenchError, match="--random-range-ratio"):
        random_requests(tokenizer, num_prompts=1, input_len=8, output_len=8, range_ratio=2)
    with pytest.raises(BenchError, match="--gsp-question-len"):
        generated_shared_prefix(tokenizer, num_groups=1, prompts_per_group=1,
                                system_prompt_len=4, question_len=0, output_len=4)


def _sharegpt(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "What is the capital of France?"},
                                  {"from": "gpt", "value": "The capital of France is Paris."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Only one turn here."}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Hi"},  # prompt of 1 token
                                  {"from": "gpt", "value": "Hello there, how can I help?"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "Name three colours please."},
                                  {"from": "gpt", "value": "Red, green and blue."},
                                  {"from": "human", "value": "More?"}]},
    {"id": "e", "messages": [{"role": "user", "content": "Count to five, slowly."},
                             {"role": "assistant", "content": "One, two, three, four, five."}]},
]


def test_sharegpt_parsing(tmp_path: Path, tokenizer: Any) -> None:
    path = _sharegpt(tmp_path, SHAREGPT)
    reqs = load_sharegpt(path, tokenizer, num_prompts=3, seed=0)
    usable = {e: s for e, s in [
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Name three colours please.", "Red, green and blue."),
        ("Count to five, slowly.", "One, two, three, four, five.")]}
    assert sorted(r.prompt for r in reqs) == sorted(usable)
    for r in reqs:
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert r.output_len == len(tokenizer.encode(usable[r.prompt], add_special_tokens=False))
    fixed = load_sharegpt(path, tokenizer, num_prompts=2, seed=0, output_len=7, as_text=False)
    assert all(r.output_len == 7 and isinstance(r.prompt, list) for r in fixed)
    assert load_sharegpt(path, tokenizer, num_prompts=3, seed=5) == \
        load_sharegpt(path, tokenizer, num_prompts=3, seed=5)


@pytest.mark.parametrize(("data", "message"), [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ({"conversations": []}, "must hold a JSON list of conversations"),
    ([{"text": "no turns"}, 3], "no entry has a 'conversations' list"),
    (SHAREGPT, "has 3 usable conversation\\(s\\) of 5 entries; 4 requested"),
])
def test_sharegpt_bad_files(tmp_path: Path, tokenizer: Any, data: Any, message: str) -> None:
    path = tmp_path / "missing.json" if data is None else _sharegpt(tmp_path, data)
    with pytest.raises(BenchError, match=message):
        load_sharegpt(path, tokenizer, num_prompts=4)
