"""The interpreter: a program state whose expressions run on a background worker.

``s += gen("x")`` only queues the expression and returns; the state's worker thread executes the
queue in order (constant text is appended, ``gen`` and ``select`` call the backend). Reading
``s["x"]`` waits on the event of ``x``. This is the asynchronous execution of SGLang's paper: the
Python code runs ahead and only blocks where it needs a value.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from sgl_lang.errors import BackendError, LangError
from sgl_lang.ir import (
    REGEX_BOOL, REGEX_FLOAT, REGEX_INT, ROLES, ConstantText, Expr, ExprList, Gen, Image,
    RoleBegin, RoleEnd, SamplingParams, Select, Variable, marker_values, to_expr,
)

if TYPE_CHECKING:
    from sgl_lang.backends.base import BaseBackend

__all__ = ["ProgramState", "ProgramStateGroup", "StreamExecutor"]

_DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL}
_END = object()


def _merge(defaults: SamplingParams | None, params: SamplingParams) -> SamplingParams:
    if defaults is None:
        return dataclasses.replace(params)
    merged = {k: (v if v is not None else getattr(defaults, k))
              for k, v in params.__dict__.items()}
    return SamplingParams(**merged)


class StreamExecutor:
    """Executes one program state's expressions in order on a worker thread."""

    def __init__(self, backend: BaseBackend | None, arguments: dict[str, Any] | None = None,
                 default_params: SamplingParams | None = None, stream: bool = False) -> None:
        self.backend = backend
        self.arguments = dict(arguments or {})
        self.default_params = default_params
        self.stream = stream
        self.sid = uuid.uuid4().hex
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.cur_role: str | None = None
        self.cur_role_begin = 0
        self.error_: BaseException | None = None
        self.children: list[StreamExecutor] = []
        self._chunks: list[tuple[str | None, str]] = []
        self._cond = threading.Condition()
        self._finished = False
        self._ended = False
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"sgl-lang-{self.sid[:8]}",
                                        daemon=True)
        self._thread.start()

    # --- the caller's side --------------------------------------------------------------------

    def submit(self, expr: Expr) -> None:
        if self._ended:
            raise LangError("this program state has ended; fork it or start a new program")
        for e in (expr.exprs if isinstance(expr, ExprList) else [expr]):
            name = getattr(e, "name", None)
            if isinstance(e, (Gen, Select)) and name is not None:
                event = self.variable_event.get(name)
                if event is None or event.is_set():  # a new value: readers wait for it
                    self.variable_event[name] = threading.Event()
        self._queue.put(expr)

    def sync(self) -> None:
        """Wait until every submitted expression has run; re-raise the first failure."""
        self._queue.join()
        if self.error_ is not None:
            raise self.error_

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put(_END)
        for child in self.children:
            child.end()

    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is None:
            if threading.current_thread() is not self._thread:  # the worker must not wait
                self.sync()                                      # for itself
            if name in self.variables:
                return self.variables[name]
            known = ", ".join(sorted(self.variables)) or "none"
            raise KeyError(f"unknown variable {name!r}: no gen or select of this program state "
                           f"has that name (variables: {known})")
        event.wait()
        if self.error_ is not None:
            raise self.error_
        return self.variables[name]

    def fork(self, size: int) -> list[StreamExecutor]:
        """``size`` copies of this state, after committing its text to the backend's cache."""
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        self.sync()
        if self.text_ and self.backend is not None:
            self.backend.cache_prefix(self.text_)
        forks = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.arguments, self.default_params,
                                   self.stream)
            child.text_ = self.text_
            child.messages_ = [dict(m) for m in self.messages_]
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.variable_event = {k: _set_event() for k in self.variables}
            child.cur_role, child.cur_role_begin = self.cur_role, self.cur_role_begin
            child.fork_start = len(self.text_)
            forks.append(child)
        self.children.extend(forks)
        return forks

    def iter_chunks(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is appended (only that of variable ``var_name`` if given), until the
        program ends."""
        index = 0
        while True:
            with self._cond:
                while index >= len(self._chunks) and not self._finished:
                    self._cond.wait()
                new = self._chunks[index:]
                index = len(self._chunks)
                finished = self._finished
            for name, chunk in new:
                if var_name is None or name == var_name:
                    yield chunk
            if finished and index >= len(self._chunks):
                if self.error_ is not None:
                    raise self.error_
                return

    # --- the worker's side ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    return
                if self.error_ is None:
                    self._execute(expr)
            except BaseException as exc:  # the caller sees it on its next read
                self.error_ = exc
                for event in self.variable_event.values():
                    event.set()
            finally:
                if expr is _END or self.error_ is not None:
                    with self._cond:
                        self._finished = self._finished or expr is _END or \
                            self.error_ is not None
                        self._cond.notify_all()
                self._queue.task_done()

    def _append(self, text: str, var: str | None = None) -> None:
        self.text_ += text
        with self._cond:
            self._chunks.append((var, text))
            self._cond.notify_all()

    def _require_backend(self) -> BaseBackend:
        if self.backend is None:
            raise LangError("no backend: call sgl.set_default_backend(sgl.RuntimeEndpoint(url)) "
                            "or pass backend= to run()")
        return self.backend

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, ConstantText):
            self._append(self._fill(expr.value))
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Variable):
            source = expr.source if isinstance(expr.source, StreamExecutor) else self
            self._append(str(source.get_var(expr.name)))
        elif isinstance(expr, Image):
            raise LangError("image(): not supported: the served models are text-only")
        elif hasattr(expr, "execute"):  # internal operations of the compiler
            expr.execute(self)
        else:
            raise LangError(f"cannot execute {expr!r}")

    def _fill(self, text: str) -> str:
        """Constant text built from arguments while tracing holds markers; put values in."""
        for marker, (kind, name) in marker_values(text):
            value = self.arguments[name] if kind == "arg" else self.get_var(name)
            text = text.replace(marker, str(value))
        return text

    def _role_begin(self, role: str) -> None:
        if role not in ROLES:
            raise LangError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        if self.cur_role is not None:
            raise LangError(f"{role}() begins inside {self.cur_role}(): end that role first")
        self.cur_role, self.cur_role_begin = role, len(self.text_)
        self._append(self._require_backend().chat_template.prefix(role))

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise LangError(f"{role}_end() without {role}_begin() (current role: "
                            f"{self.cur_role})")
        template = self._require_backend().chat_template
        content = self.text_[self.cur_role_begin + len(template.prefix(role)):]
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
        self._append(template.suffix(role))

    def _set_var(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self.variable_event.setdefault(name, threading.Event()).set()

    def _gen(self, expr: Gen) -> None:
        backend = self._require_backend()
        params = _merge(self.default_params, expr.params)
        dtype_regex = expr.dtype in _DTYPE_REGEX and params.regex is None
        if dtype_regex:
            params.regex = _DTYPE_REGEX[expr.dtype]
            if not getattr(backend, "supports_regex", True):
                params.regex = None
        try:
            text, meta = self._call_gen(backend, params, expr)
        except BackendError as exc:
            # without a grammar backend, dtype falls back to parsing free text
            if not (dtype_regex and params.regex and exc.status == 400 and "regex" in str(exc)):
                raise
            backend.supports_regex = False
            params.regex = None
            text, meta = self._call_gen(backend, params, expr)
        self._set_var(expr.name, expr.convert(text), meta)

    def _call_gen(self, backend: BaseBackend, params: SamplingParams,
                  expr: Gen) -> tuple[str, dict[str, Any]]:
        if not self.stream:
            text, meta = backend.generate(self, params, expr.logprobs)
            self._append(text, expr.name)
            return text, meta
        text, meta = "", {}
        for chunk, chunk_meta in backend.generate_stream(self, params, expr.logprobs):
            if chunk:
                text += chunk
                self._append(chunk, expr.name)
            if chunk_meta is not None:
                meta = chunk_meta
        return text, meta

    def _select(self, expr: Select) -> None:
        from sgl_lang.choices import token_length_normalized

        if not expr.choices:
            raise LangError(f"select({expr.name!r}): choices must not be empty")
        method = expr.choices_method or token_length_normalized
        decision = self._require_backend().select(self, expr.choices, expr.temperature, method)
        self._append(decision.decision, expr.name)
        self._set_var(expr.name, decision.decision, decision.meta_info)


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


class _RoleScope:
    def __init__(self, state: ProgramState, role: str) -> None:
        self.state, self.role = state, role

    def __enter__(self) -> ProgramState:
        self.state.executor.submit(RoleBegin(self.role))
        return self.state

    def __exit__(self, *exc: object) -> None:
        self.state.executor.submit(RoleEnd(self.role))


class ProgramState:
    """The ``s`` of a program: ``s += expr``, ``s["var"]``, ``s.text()``, ``s.fork(n)``."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.executor = executor

    def __iadd__(self, other: Any) -> ProgramState:
        self.executor.submit(to_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.sync()
        self.executor._set_var(name, value, None)

    def __contains__(self, name: str) -> bool:
        self.executor.sync()
        return name in self.executor.variables

    def _role(self, role: str, expr: Any = None) -> _RoleScope | None:
        if expr is None:
            return _RoleScope(self, role)
        self += ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)])
        return None

    def system(self, expr: Any = None) -> _RoleScope | None:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> _RoleScope | None:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> _RoleScope | None:
        return self._role("assistant", expr)

    def fork(self, size: int = 1) -> ProgramStateGroup:
        return ProgramStateGroup([ProgramState(e) for e in self.executor.fork(size)], self)

    def text(self) -> str:
        self.executor.sync()
        return self.executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.executor.sync()
        return [dict(m) for m in self.executor.messages_]

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def get_meta_info(self, name: str) -> Any:
        self.executor.get_var(name)
        return self.executor.meta_info.get(name)

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> BaseException | None:
        self.executor._queue.join()
        return self.executor.error_

    def end(self) -> None:
        self.executor.end()

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is generated; pass ``var_name`` for one variable's text only."""
        return self.executor.iter_chunks(var_name)

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """:meth:`text_iter` for asyncio code."""
        loop = asyncio.get_running_loop()
        chunks = self.executor.iter_chunks(var_name)
        done = object()
        while True:
            chunk = await loop.run_in_executor(None, next, chunks, done)
            if chunk is done:
                return
            yield chunk

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of ``s.fork(n)``: index them, ``+=`` to all, then ``join()``."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. ``gather_variable``: each variable first set in the branches
        becomes, in the parent, the list of its values; ``concate_and_append``: the branches'
        new text is appended to the parent, in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"unknown join mode {mode!r}; modes: gather_variable, "
                             f"concate_and_append")
        for state in self.states:
            state.sync()
            state.end()
        parent = self.parent.executor
        if mode == "gather_variable":
            parent.sync()
            inherited = set(parent.variables)
            names = [n for n in self.states[0].executor.variables if n not in inherited]
            for name in names:
                parent._set_var(name, [s.executor.variables.get(name) for s in self.states],
                                [s.executor.meta_info.get(name) for s in self.states])
        else:
            parent.submit(ConstantText("".join(
                s.executor.text_[s.executor.fork_start:] for s in self.states)))
