"""Turning token ids into text, all at once or a few tokens at a time.

Decoding one token at a time goes wrong in two ways. A byte-level BPE token can hold part of a
multi-byte UTF-8 character (an emoji is often split over two or three tokens), so decoding it
alone gives U+FFFD. And SentencePiece tokenizers drop the leading space of the first token of
whatever they decode, so ``"▁world"`` decoded alone loses its space.

:class:`IncrementalDetokenizer` avoids both. With a fast (Rust) tokenizer it runs on
``tokenizers``' own ``DecodeStream``, primed with the last prompt tokens as context, which
holds back the bytes of a character until it is complete (faster per token than decoding
windows in Python, ``benchmarks/detokenizer.py``; a stray byte that never completes is emitted after
:data:`MAX_PENDING` tokens, as U+FFFD, as a full decode writes it). Otherwise, and for special
tokens kept with spaces between them (which ``DecodeStream`` does not write), it keeps two
offsets into the ids seen so far: the text of ``ids[prefix_offset:read_offset]`` was already
emitted; decoding ``ids[prefix_offset:]`` and dropping that known prefix gives the new text,
held back while it ends with U+FFFD (a character not complete yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer", "decode_tokens"]

#: prompt tokens kept as context for the first output token (its leading space)
PROMPT_CONTEXT = 5
#: a UTF-8 character has at most 4 bytes, so more pending tokens than this ending in U+FFFD
#: mean the bytes are invalid for good: emit them rather than wait forever
MAX_PENDING = 4
REPLACEMENT = "\ufffd"


def _special_ids(tokenizer: Any) -> frozenset[int]:
    cached = getattr(tokenizer, "_sgl_special_ids", None)
    if cached is None:
        cached = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        try:
            tokenizer._sgl_special_ids = cached
        except AttributeError:  # a tokenizer that refuses new attributes
            pass
    return cached


def decode_tokens(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool = True,
                  spaces_between_special_tokens: bool = True) -> str:
    """Decode ``ids`` the way SGLang's sampling parameters ask.

    ``skip_special_tokens`` drops special tokens (BOS, EOS, chat markers). When they are kept,
    ``spaces_between_special_tokens`` puts one space between a special token and the text next
    to it, as Hugging Face's Python tokenizers do (fast tokenizers ignore that flag, so it is
    done here). Tokenization spaces are never "cleaned up": that step deletes real spaces
    before punctuation and would make incremental and full decoding disagree.
    """
    ids = list(ids)
    if skip_special_tokens or not spaces_between_special_tokens:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    special = _special_ids(tokenizer)
    if not special.intersection(ids):
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    parts: list[str] = []
    run: list[int] = []
    for token in ids:
        if token in special:
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False))
                run = []
            parts.append(tokenizer.decode([token], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False))
        else:
            run.append(token)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False))
    return " ".join(parts)


class IncrementalDetokenizer:
    """Text of a growing list of token ids, emitted piece by piece.

    :param tokenizer: a Hugging Face tokenizer.
    :param prompt_ids: the prompt; its last few tokens give the first output token its leading
        space (they are context only, their text is never emitted).
    :param skip_special_tokens: as in :func:`decode_tokens`.
    :param spaces_between_special_tokens: as in :func:`decode_tokens`.
    :param use_stream: run on ``DecodeStream`` where the tokenizer allows it (False: always
        the Python path; for comparisons).

    ``"".join`` of everything :meth:`push` and :meth:`flush` return equals the text of the
    output ids decoded after the prompt context, and no piece but the one from :meth:`flush`
    ends inside a character.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, use_stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        backend = getattr(tokenizer, "_tokenizer", None)
        spaced = (not skip_special_tokens and spaces_between_special_tokens
                  and bool(_special_ids(tokenizer)))
        #: the Rust tokenizer DecodeStream steps on; None: the Python path below
        self.backend = backend if (use_stream and isinstance(backend, tokenizers.Tokenizer)
                                   and not spaced) else None
        self.stream: DecodeStream | None = None
        self.held = 0  # ids the stream holds back (no text yet)
        if self.backend is not None:
            self._restart()

    def _restart(self) -> None:
        self.stream = DecodeStream(ids=self.ids[-PROMPT_CONTEXT:],
                                   skip_special_tokens=self.skip_special_tokens)
        self.held = 0

    def _held_text(self) -> str:
        """The text of the held ids, decoded after the ids before them as context."""
        context = self.ids[-self.held - PROMPT_CONTEXT:-self.held]
        full = self._decode([*context, *self.ids[-self.held:]])
        before = self._decode(context)
        return full[len(before):] if full.startswith(before) else full

    def _decode(self, ids: Sequence[int]) -> str:
        return decode_tokens(self.tokenizer, ids, skip_special_tokens=self.skip_special_tokens,
                             spaces_between_special_tokens=self.spaces_between_special_tokens)

    def push(self, new_ids: Iterable[int]) -> str:
        """Add output ids; return the text that became printable (may be empty)."""
        if self.stream is not None:
            return self._push_stream(new_ids)
        self.ids.extend(int(t) for t in new_ids)
        if len(self.ids) == self.read_offset:
            return ""
        return self._advance(final=False)

    def _push_stream(self, new_ids: Iterable[int]) -> str:
        assert self.stream is not None
        pieces = []
        for token in new_ids:
            self.ids.append(int(token))
            chunk = self.stream.step(self.backend, int(token))
            if chunk is not None:
                pieces.append(chunk)
                self.held = 0
                continue
            self.held += 1
            if self.held > MAX_PENDING:  # bytes that will never make a character
                pieces.append(self._held_text())
                self._restart()
        return "".join(pieces)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end); call once, at
        the end of the request."""
        if self.stream is not None:
            text = self._held_text() if self.held else ""
            self._restart()
            return text
        if len(self.ids) == self.read_offset:
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        end = len(self.ids)
        if not final and full.endswith(REPLACEMENT):
            # the last few tokens may hold the start of a character: emit what comes before
            for held in range(1, min(MAX_PENDING, end - self.read_offset - 1) + 1):
                shorter = self._decode(self.ids[self.prefix_offset:end - held])
                if not shorter.endswith(REPLACEMENT):
                    full, end = shorter, end - held
                    break
            else:
                if end - self.read_offset <= MAX_PENDING:
                    return ""  # wait for the rest of the character
        if not full.startswith(prefix):
            # a tokenizer that rewrites earlier text given more context; best effort
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            new = full[common:] if len(full) > len(prefix) else ""
        else:
            new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        return new
