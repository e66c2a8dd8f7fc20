"""Registers the ``outlines`` grammar backend; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["SGL_REQUIRES", "sgl_register_grammar_backends"]

SGL_REQUIRES = ["outlines_core"]


@hookimpl
def sgl_register_grammar_backends(register: RegisterFn) -> None:
    register("outlines", "sgl_grammar_outlines.backend:OutlinesBackend")
