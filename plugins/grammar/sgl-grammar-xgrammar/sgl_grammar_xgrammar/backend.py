"""Constrained decoding with xgrammar: JSON schema, regex, EBNF (GBNF syntax, ``root ::= ...``)
and structural tags; jump-forward with xgrammar's own forced-token search.

xgrammar is imported when the backend is built (in the scheduler), not when the class is loaded,
so reading :attr:`XGrammarBackend.kinds` in the server process stays cheap.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

from sgl.grammar import BaseGrammarBackend, BaseGrammarMatcher, GrammarError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = ["XGrammarBackend", "XGrammarMatcher"]


def _structural_tag(xgr: Any, spec: str) -> Any:
    """SGLang's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers"}``)
    as xgrammar's ``StructuralTag``; any other JSON is xgrammar's own format."""
    value = json.loads(spec)
    if isinstance(value, dict) and "structures" in value:
        tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                      end=s["end"]) for s in value["structures"]]
        return xgr.StructuralTag.from_legacy_structural_tag(tags, value.get("triggers", []))
    return spec


def _grammar(xgr: Any, kind: str, spec: str) -> Any:
    """The uncompiled ``xgr.Grammar`` of a constraint (parses it; no tokenizer needed)."""
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(_structural_tag(xgr, spec))
    raise GrammarError(kind, "unknown constraint kind")


def _message(exc: Exception) -> str:
    """xgrammar's errors start with a time stamp and a C++ source position: drop them."""
    text = str(exc).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ": " in text and (".cc:" in text.split(": ", 1)[0] or ".h:" in text.split(": ", 1)[0]):
        text = text.split(": ", 1)[1]
    return text.replace("Check failed: (error.empty()) is false: ", "")


class XGrammarMatcher(BaseGrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def find_jump_forward_tokens(self) -> list[int]:
        return list(self.matcher.find_jump_forward_tokens())


class XGrammarBackend(BaseGrammarBackend):
    """xgrammar: a grammar compiler with a per-token-state mask cache (fast masks)."""

    name: ClassVar[str] = "xgrammar"
    kinds: ClassVar[frozenset[str]] = frozenset({"json_schema", "regex", "ebnf",
                                                 "structural_tag"})

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()
                 ) -> None:
        super().__init__(tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        # sgl caches compiled grammars itself; one thread per compile, several compiles at once
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    @classmethod
    def validate(cls, kind: str, spec: str) -> None:
        import xgrammar as xgr

        try:
            _grammar(xgr, kind, spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise GrammarError(kind, _message(exc)) from None

    def compile(self, kind: str, spec: str) -> Any:
        try:
            return self.compiler.compile_grammar(_grammar(self.xgr, kind, spec))
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise GrammarError(kind, _message(exc)) from None

    def serialize(self, compiled: Any) -> bytes:
        return compiled.serialize_json().encode()

    def deserialize(self, data: bytes) -> Any:
        return self.xgr.CompiledGrammar.deserialize_json(data.decode(), self.info)

    def new_matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled))
