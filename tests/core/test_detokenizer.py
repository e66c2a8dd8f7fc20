"""Incremental detokenization: the pieces add up to the full decode, no piece ends inside a
multi-byte character, and SentencePiece leading spaces survive, for byte-level BPE (the bundled
SmolLM2 and a toy) and SentencePiece-style BPE with byte fallback."""

from __future__ import annotations

from typing import Any

import pytest
from _toy_tokenizers import byte_level_bpe, sentencepiece_bpe

from sgl.server.detokenizer import MAX_PENDING, IncrementalDetokenizer, decode_tokens

TEXTS = [
    "Hello 世界 😀 café naïve",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag, 🤖🎉",
    "日本語のテキストです。中文字符，한국어",
    "Ünïcödé àèìòù ß Ωμέγα Привет",
    "plain ascii, with  double  spaces and a tab\tend",
]


@pytest.fixture(params=["DecodeStream", "python"])
def use_stream(request: pytest.FixtureRequest) -> bool:
    """Both paths of the detokenizer: tokenizers' DecodeStream and the window decoding."""
    return request.param == "DecodeStream"


@pytest.fixture(scope="module", params=["smollm2", "byte-level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    if request.param == "smollm2":
        from sgl.model_loader import load_tokenizer

        return load_tokenizer(None)
    return byte_level_bpe() if request.param == "byte-level" else sentencepiece_bpe()


def run(tok: Any, ids: list[int], splits: list[int], prompt: list[int] = (),  # type: ignore[assignment]
        **kw: Any) -> list[str]:
    """Feed ``ids`` cut at ``splits``; return every piece, the flushed rest last."""
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    bounds = [0, *splits, len(ids)]
    pieces = [detok.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer: Any, use_stream: bool, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = run(tokenizer, ids, list(range(1, len(ids))), use_stream=use_stream)
    assert "".join(pieces) == tokenizer.decode(ids) == decode_tokens(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces), pieces


@pytest.mark.parametrize("text", TEXTS[:4])
def test_every_split_point(tokenizer: Any, use_stream: bool, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    for cut in range(len(ids) + 1):
        pieces = run(tokenizer, ids, [cut], use_stream=use_stream)
        assert "".join(pieces) == full, cut
        assert not any("\ufffd" in p for p in pieces), (cut, pieces)


def test_leading_space_after_the_prompt(tokenizer: Any, use_stream: bool) -> None:
    """The first output token keeps its leading space: SentencePiece drops it when the token is
    decoded alone, so the prompt's last tokens are decoded with it as context."""
    ids = tokenizer.encode("hello world the fox 😀", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]
    assert tokenizer.decode(prompt) == "hello"
    pieces = run(tokenizer, output, list(range(1, len(output))), prompt=prompt,
                 use_stream=use_stream)
    assert "".join(pieces) == " world the fox 😀"
    assert not any("\ufffd" in p for p in pieces)


def test_decode_stream_is_used_where_it_writes_the_same_text(tokenizer: Any) -> None:
    assert IncrementalDetokenizer(tokenizer).stream is not None
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False,
                                  spaces_between_special_tokens=False)
    assert kept.stream is not None
    # spaces around kept special tokens are sgl's (decode_tokens): the Python path
    spaced = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert spaced.stream is None
    assert IncrementalDetokenizer(tokenizer, use_stream=False).stream is None


def test_special_tokens(tokenizer: Any, use_stream: bool) -> None:
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    body = tokenizer.encode("hello world", add_special_tokens=False)
    ids = [im_start, *body, im_end]
    steps = list(range(1, len(ids)))
    assert "".join(run(tokenizer, ids, steps, use_stream=use_stream)) == "hello world"
    kept = "".join(run(tokenizer, ids, steps, skip_special_tokens=False,
                       spaces_between_special_tokens=False, use_stream=use_stream))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False)
    assert kept.startswith("<|im_start|>") and kept.endswith("world<|im_end|>")
    spaced = "".join(run(tokenizer, ids, steps, skip_special_tokens=False,
                         use_stream=use_stream))
    assert spaced == decode_tokens(tokenizer, ids, skip_special_tokens=False)
    assert spaced.endswith("world <|im_end|>")
    assert spaced.replace(" ", "") == kept.replace(" ", "")


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "python"])
def test_invalid_bytes_are_emitted_rather_than_held_forever(use_stream: bool) -> None:
    tok = sentencepiece_bpe()
    stray = tok.convert_tokens_to_ids("<0x80>")  # a continuation byte with no lead byte
    detok = IncrementalDetokenizer(tok, use_stream=use_stream)
    assert (detok.stream is not None) == use_stream
    pieces = [detok.push([stray]) for _ in range(MAX_PENDING + 2)]
    assert any(pieces), "held back for ever"
    assert "".join(pieces) + detok.flush() == "\ufffd" * (MAX_PENDING + 2)
