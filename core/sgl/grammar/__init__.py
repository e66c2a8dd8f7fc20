"""Grammar backends: the base classes grammar plugins implement."""

from __future__ import annotations

from sgl.grammar.base import BaseGrammarBackend, BaseGrammarMatcher

__all__ = ["BaseGrammarBackend", "BaseGrammarMatcher"]
