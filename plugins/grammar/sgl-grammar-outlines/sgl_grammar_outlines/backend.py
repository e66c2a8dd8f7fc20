"""Constrained decoding with outlines-core: a JSON schema becomes a regular expression, a
regular expression becomes a token-level automaton (an ``Index``) over the vocabulary.

The automaton is built once per constraint (the compile step, slower than xgrammar's for large
schemas, since every vocabulary token is walked through it); masks are then a table look-up.
outlines-core does no context-free grammars (no ``ebnf``), and its JSON schema regex leaves
integer ``minimum``/``maximum`` unchecked. Jump-forward applies where exactly one token is
allowed.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

from sgl.grammar import BaseGrammarBackend, BaseGrammarMatcher, GrammarError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = ["OutlinesBackend", "OutlinesMatcher", "token_bytes"]

#: tokens one matcher can roll back (speculative decoding and jump-forward need few)
MAX_ROLLBACK = 64
#: longest run of single-allowed tokens appended at once
MAX_JUMP = 32


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table (byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Every normal token's bytes -> its ids, for byte-level BPE (``Ġ`` = space) and
    SentencePiece (``▁`` = space, ``<0xAB>`` = one byte) vocabularies; special tokens left out."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = _byte_decoder()
    out: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special:
            continue
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            data = bytes([int(token[3:5], 16)])
        elif all(c in decoder for c in token):
            data = bytes(decoder[c] for c in token)
        else:
            data = token.replace("▁", " ").encode()
        out.setdefault(data, []).append(token_id)
    return out


def _regex(kind: str, spec: str) -> str:
    if kind == "json_schema":
        from outlines_core.json_schema import build_regex_from_schema

        try:
            return build_regex_from_schema(spec)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(kind, str(exc)) from None
    if kind == "regex":
        try:  # outlines-core's own error says only "Failed to build DFA"; Python's says where
            re.compile(spec)
        except re.error as exc:
            raise GrammarError(kind, str(exc)) from None
        return spec
    raise GrammarError(kind, "outlines-core cannot compile it")


class OutlinesMatcher(BaseGrammarMatcher):
    def __init__(self, guide: Any, eos_token_id: int, words: int) -> None:
        self.guide = guide
        self.eos = eos_token_id
        self.words = words  # bitmask words per row
        self.ended = False
        self._scratch: torch.Tensor | None = None

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        out = bitmask[row]
        self.guide.write_mask_into(out.data_ptr(), out.numel(), out.element_size())

    def accept_token(self, token_id: int) -> bool:
        if self.ended:
            return False
        if token_id == self.eos:  # allowed in final states, but not a transition of the index
            self.ended = bool(self.guide.is_finished())
            return self.ended
        try:
            self.guide.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        return True

    def is_terminated(self) -> bool:
        return self.ended

    def rollback(self, num_tokens: int) -> None:
        if self.ended:  # the stop token moved no state
            self.ended, num_tokens = False, num_tokens - 1
        if num_tokens > 0:
            self.guide.rollback_state(num_tokens)

    def find_jump_forward_tokens(self) -> list[int]:
        forced: list[int] = []
        while len(forced) < MAX_JUMP and not self.guide.is_finished():
            token = self._only_allowed()
            if token is None or token == self.eos:
                break
            self.guide.advance(token, return_tokens=False)
            forced.append(token)
        if forced:
            self.guide.rollback_state(len(forced))
        return forced

    def _only_allowed(self) -> int | None:
        """The one token allowed next, if exactly one is (from the mask: no token list)."""
        import torch

        if self._scratch is None:
            self._scratch = torch.zeros((1, self.words), dtype=torch.int32)
        words = self._scratch
        self.fill_next_token_bitmask(words, 0)
        nonzero = words[0].nonzero()
        if nonzero.numel() != 1:
            return None
        i = int(nonzero[0, 0])
        word = int(words[0, i]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit
            return None
        return 32 * i + word.bit_length() - 1


class OutlinesBackend(BaseGrammarBackend):
    """outlines-core: regular languages as token automata."""

    name: ClassVar[str] = "outlines"
    kinds: ClassVar[frozenset[str]] = frozenset({"json_schema", "regex"})

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()
                 ) -> None:
        super().__init__(tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        import outlines_core

        self.oc = outlines_core
        self.eos = stop_token_ids[0] if stop_token_ids else tokenizer.eos_token_id
        vocab = {data: [i for i in ids if i < vocab_size]
                 for data, ids in token_bytes(tokenizer).items()}
        self.vocabulary = outlines_core.Vocabulary(self.eos, {k: v for k, v in vocab.items() if v})
        self.words = (vocab_size + 31) // 32

    @classmethod
    def validate(cls, kind: str, spec: str) -> None:
        _regex(kind, spec)

    def compile(self, kind: str, spec: str) -> Any:
        regex = _regex(kind, spec)
        try:
            return self.oc.Index(regex, self.vocabulary)
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(kind, f"outlines-core cannot build an automaton for it ({exc})"
                               ) from None

    def new_matcher(self, compiled: Any) -> OutlinesMatcher:
        return OutlinesMatcher(self.oc.Guide(compiled, max_rollback=MAX_ROLLBACK), self.eos,
                               self.words)
