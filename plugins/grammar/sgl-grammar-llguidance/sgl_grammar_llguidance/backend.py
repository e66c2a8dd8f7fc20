"""Constrained decoding with llguidance: JSON schema, regex and EBNF (GBNF ``root ::= ...`` or
Lark syntax); jump-forward with llguidance's forced tokens.

llguidance computes masks lazily from the grammar, so "compiling" is building one matcher (which
checks the grammar against the tokenizer); each request gets a deep copy of it. A matcher cannot
be pickled, so the compile worker sends back the checked grammar text and the scheduler builds
the matcher from it again (milliseconds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sgl.grammar import BaseGrammarBackend, BaseGrammarMatcher, GrammarError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = ["LLGuidanceBackend", "LLGuidanceMatcher"]

#: sgl's constraint kinds as llguidance's grammar formats
_FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "gbnf"}


def _grammar(kind: str, spec: str) -> str:
    """llguidance's grammar text of a constraint, checked without a tokenizer."""
    import llguidance

    if kind not in _FORMATS:
        raise GrammarError(kind, "llguidance cannot compile it")
    try:
        if kind == "json_schema":  # fixed separators, as with xgrammar
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                spec, defaults={"whitespace_flexible": False})
        else:
            grammar = llguidance.grammar_from(_FORMATS[kind], spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(kind, str(exc)) from None
    if error:
        raise GrammarError(kind, error)
    return grammar


class LLGuidanceMatcher(BaseGrammarMatcher):
    def __init__(self, matcher: Any, fill: Any) -> None:
        self.matcher = matcher
        self._fill = fill

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self.matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.is_stopped():
            return False
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def find_jump_forward_tokens(self) -> list[int]:
        return list(self.matcher.compute_ff_tokens())


class LLGuidanceBackend(BaseGrammarBackend):
    """llguidance: an Earley parser over a lazily built lexer (fast start, no compile step)."""

    name: ClassVar[str] = "llguidance"
    kinds: ClassVar[frozenset[str]] = frozenset(_FORMATS)

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()
                 ) -> None:
        super().__init__(tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        eos = stop_token_ids[0] if stop_token_ids else None
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=eos)
        self._fill = llguidance.torch.fill_next_token_bitmask

    @classmethod
    def validate(cls, kind: str, spec: str) -> None:
        _grammar(kind, spec)

    def compile(self, kind: str, spec: str) -> Any:
        """(the grammar text, its matcher)."""
        return self._matcher(kind, _grammar(kind, spec))

    def serialize(self, compiled: Any) -> bytes:
        grammar, _ = compiled
        return grammar.encode()

    def deserialize(self, data: bytes) -> Any:
        return self._matcher("grammar", data.decode())

    def _matcher(self, kind: str, grammar: str) -> tuple[str, Any]:
        matcher = self.llg.LLMatcher(self.ll_tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(kind, matcher.get_error())
        return grammar, matcher

    def new_matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled[1].deep_copy(), self._fill)
