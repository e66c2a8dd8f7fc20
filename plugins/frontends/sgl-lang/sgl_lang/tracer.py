"""The tracer: run a program once with placeholder arguments and record what it appends.

Nothing is generated. ``s["x"]`` gives a :class:`~sgl_lang.ir.Variable` placeholder, and an
argument formatted into a string leaves a marker, so the recording says which text is constant.
The constant text before the first generation, argument or variable is the program's prefix,
which ``run_batch`` sends once so that every instance finds it in the cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sgl_lang.errors import LangError
from sgl_lang.ir import (
    ConstantText, Expr, ExprList, RoleBegin, RoleEnd, Variable, marker_values, to_expr,
)

if TYPE_CHECKING:
    from sgl_lang.backends.base import BaseBackend

__all__ = ["ForkOp", "JoinOp", "TracerGroup", "TracerState", "TracingError", "extract_prefix"]

_ids = itertools.count()


class TracingError(LangError):
    """The program did something that needs real values (read its text, ...)."""


@dataclass(eq=False)
class ForkOp:
    children: list[TracerState]


@dataclass(eq=False)
class JoinOp:
    children: list[TracerState]
    mode: str


class _TracerRole:
    def __init__(self, state: TracerState, role: str) -> None:
        self.state, self.role = state, role

    def __enter__(self) -> TracerState:
        self.state.items.append(RoleBegin(self.role))
        return self.state

    def __exit__(self, *exc: object) -> None:
        self.state.items.append(RoleEnd(self.role))


class TracerState:
    """Stands in for the program state while tracing; records into ``items``."""

    def __init__(self, backend: BaseBackend | None = None,
                 parent: TracerState | None = None) -> None:
        self.backend = backend
        self.parent = parent
        self.id = next(_ids)
        self.items: list[Expr | ForkOp | JoinOp] = []

    def __iadd__(self, other: Any) -> TracerState:
        expr = to_expr(other)
        self.items.extend(expr.exprs if isinstance(expr, ExprList) else [expr])
        return self

    def __getitem__(self, name: str) -> Variable:
        return Variable(name, source=self)

    def _role(self, role: str, expr: Any = None) -> _TracerRole | None:
        if expr is None:
            return _TracerRole(self, role)
        self += ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)])
        return None

    def system(self, expr: Any = None) -> _TracerRole | None:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> _TracerRole | None:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> _TracerRole | None:
        return self._role("assistant", expr)

    def fork(self, size: int = 1) -> TracerGroup:
        children = [TracerState(self.backend, self) for _ in range(size)]
        self.items.append(ForkOp(children))
        return TracerGroup(children, self)

    def _needs_values(self, *args: Any, **kwargs: Any) -> Any:
        raise TracingError("a traced program cannot read its text or messages")

    text = messages = get_meta_info = sync = _needs_values

    def __setitem__(self, name: str, value: Any) -> None:
        raise TracingError("a traced program cannot set variables")


class TracerGroup:
    def __init__(self, children: list[TracerState], parent: TracerState) -> None:
        self.children, self.parent = children, parent

    def __len__(self) -> int:
        return len(self.children)

    def __getitem__(self, i: int) -> TracerState:
        return self.children[i]

    def __iter__(self):
        return iter(self.children)

    def __iadd__(self, other: Any) -> TracerGroup:
        others = other if isinstance(other, (list, tuple)) else [other] * len(self.children)
        for child, expr in zip(self.children, others):
            child += expr
        return self

    def join(self, mode: str = "gather_variable") -> None:
        self.parent.items.append(JoinOp(self.children, mode))


def extract_prefix(state: TracerState) -> str:
    """The constant text a traced program starts with (roles rendered with the backend's chat
    template), up to its first generation, argument, variable or fork."""
    template = getattr(state.backend, "chat_template", None)
    prefix = ""
    for item in state.items:
        if isinstance(item, ConstantText):
            found = marker_values(item.value)
            if found:
                return prefix + item.value[:item.value.index(found[0][0])]
            prefix += item.value
        elif isinstance(item, (RoleBegin, RoleEnd)) and template is not None:
            prefix += template.prefix(item.role) if isinstance(item, RoleBegin) \
                else template.suffix(item.role)
        else:
            break
    return prefix
