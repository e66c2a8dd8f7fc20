"""Grammar backends for structured output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_grammar_backends(register: RegisterFn) -> None:
    """Register grammar backends (JSON schema, regex, EBNF constrained decoding) by name.

    Call ``register(name, "module:Class")``; the class subclasses
    :class:`sgl.grammar.BaseGrammarBackend` (``kinds``, ``validate``, ``compile``,
    ``new_matcher``) and is chosen with ``--grammar-backend NAME`` (default ``auto``: ``xgrammar``
    when registered, else none). The scheduler compiles on worker threads, caches compiled
    grammars and applies the matchers' bitmasks; see docs/grammar.md.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """
