"""Grammar backends: the base classes grammar plugins implement."""

from __future__ import annotations

from sgl.grammar.base import CONSTRAINT_KINDS, BaseGrammarBackend, BaseGrammarMatcher, GrammarError

__all__ = ["CONSTRAINT_KINDS", "BaseGrammarBackend", "BaseGrammarMatcher", "GrammarError"]
