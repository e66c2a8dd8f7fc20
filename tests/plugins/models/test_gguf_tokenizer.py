"""The bundled GGUF's tokenizer splits texts as SmolLM2's own tokenizer does.

transformers rebuilds a GGUF file's BPE vocabulary and merges but, for a ``tokenizer.ggml.pre``
type it has no entry for (SmolLM's ``smollm``), falls back to GPT-2's split, which tokenizes
some texts differently from the model's training: a run of spaces before a digit became single
spaces. The llama plugin's GGUF architecture names llama.cpp's regexes for the type and
``load_tokenizer`` applies them. The reference below is SmolLM2's own ``tokenizer.json``
pre-tokenizer (digits one by one, then GPT-2's byte-level split) over the same vocabulary."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.model_loader import bundled_model_path, load_tokenizer


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Any, Any]:
    from tokenizers import pre_tokenizers

    served = load_tokenizer(bundled_model_path())
    reference = copy.deepcopy(served)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return served, reference


def pieces(tokenizer: Any, text: str) -> list[str]:
    return [tokenizer.decode([i]) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def test_spaces_before_a_digit_stay_one_token(tokenizers: tuple[Any, Any]) -> None:
    served, _ = tokenizers
    assert pieces(served, "a  12\n 8") == ["a", "  ", "1", "2", "\n ", "8"]


TEXT = st.text(alphabet=st.sampled_from(list("ab Zé中 \t\n0123456789.,'-(/")), max_size=48)


@settings(max_examples=400, deadline=None)
@given(text=TEXT)
def test_every_text_tokenizes_as_smollm2_own_tokenizer(tokenizers: tuple[Any, Any],
                                                       text: str) -> None:
    served, reference = tokenizers
    assert served(text)["input_ids"] == reference(text)["input_ids"], repr(text)
