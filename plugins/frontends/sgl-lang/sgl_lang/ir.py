"""The expressions of the language: what ``s += ...`` appends to a program state.

Every primitive (``gen``, ``select``, roles, constant text) is an :class:`Expr`; ``+`` joins
expressions into an :class:`ExprList`. The interpreter executes them in order; the tracer records
them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "Argument", "ConstantText", "Expr", "ExprList",
    "Gen", "Image", "RoleBegin", "RoleEnd", "Select", "SamplingParams", "Variable", "marker",
    "marker_values", "to_expr",
]

_MARKER = re.compile("\x00(arg|var):([^\x00]*)\x00")


def marker(kind: str, name: str) -> str:
    """What an argument or variable placeholder becomes when the traced program formats it into
    a string: a marker that the tracer cuts the prefix at and the compiler fills in."""
    return f"\x00{kind}:{name}\x00"


def marker_values(text: str) -> list[tuple[str, tuple[str, str]]]:
    return [(m.group(0), (m.group(1), m.group(2))) for m in _MARKER.finditer(text)]


REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+"
REGEX_BOOL = r"(True|False)"
ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every expression. ``a + b`` (or ``"text" + expr``) is an :class:`ExprList`."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])


def to_expr(value: Any) -> Expr:
    """A string, number or expression as an expression."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (str, int, float, bool)):
        return ConstantText(str(value))
    raise TypeError(f"cannot append a {type(value).__name__} to a program state: use a string, "
                    f"a number or an expression (gen, select, user(...), ...)")


@dataclass(eq=False)
class ExprList(Expr):
    exprs: list[Expr]

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for e in self.exprs:
            flat.extend(e.exprs if isinstance(e, ExprList) else [e])
        self.exprs = flat


@dataclass(eq=False)
class ConstantText(Expr):
    value: str


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class Image(Expr):
    path: str


@dataclass
class SamplingParams:
    """Sampling parameters of one ``gen``; ``None`` means the backend's default."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | None = None

    def to_sgl(self) -> dict[str, Any]:
        """The ``sampling_params`` of SGLang's native ``/generate``, unset fields left out."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: SamplingParams = field(default_factory=SamplingParams)
    dtype: type | None = None
    logprobs: dict[str, Any] = field(default_factory=dict)  # SGLang's logprob fields to send

    def convert(self, text: str) -> Any:
        """The generated text as the requested ``dtype``."""
        if self.dtype in (None, str):
            return text
        pattern = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL}[self.dtype]
        match = re.search(pattern, text)
        if match is None:
            raise ValueError(f"gen({self.name!r}, dtype={self.dtype.__name__}): the model "
                             f"generated {text!r}, which holds no {self.dtype.__name__}")
        if self.dtype is bool:
            return match.group(0) == "True"
        return self.dtype(match.group(0))


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: Any = None


@dataclass(eq=False)
class Variable(Expr):
    """A reference to a variable of a program state (what ``s["name"]`` is while tracing)."""

    name: str
    source: Any = None  # the tracer state that produces it

    def __str__(self) -> str:
        return marker("var", self.name)

    __format__ = lambda self, spec: str(self)  # noqa: E731


@dataclass(eq=False)
class Argument(Expr):
    """A placeholder for a program argument while tracing."""

    name: str

    def __str__(self) -> str:
        return marker("arg", self.name)

    __format__ = lambda self, spec: str(self)  # noqa: E731
