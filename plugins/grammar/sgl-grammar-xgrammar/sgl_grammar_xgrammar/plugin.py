"""Registers the ``xgrammar`` grammar backend; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["SGL_REQUIRES", "sgl_register_grammar_backends"]

SGL_REQUIRES = ["xgrammar"]


@hookimpl
def sgl_register_grammar_backends(register: RegisterFn) -> None:
    register("xgrammar", "sgl_grammar_xgrammar.backend:XGrammarBackend")
