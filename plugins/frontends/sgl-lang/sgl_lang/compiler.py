"""The compiler: a traced program as a graph of expressions, run in topological order.

Nodes are the recorded expressions of every stream (the main state and each fork branch).
Edges: each node follows the previous one of its stream; a branch's first node follows its fork;
a join follows the last node of every branch; a variable read from another stream follows the
expression that produces it. Running submits the nodes in a topological order of that graph to
one executor per stream, so independent branches run in parallel.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from sgl_lang.errors import LangError
from sgl_lang.interpreter import ProgramState, ProgramStateGroup, StreamExecutor
from sgl_lang.ir import Argument, ConstantText, Gen, Select, Variable
from sgl_lang.tracer import ForkOp, JoinOp, TracerState

if TYPE_CHECKING:
    from sgl_lang.function import SglFunction

__all__ = ["CompiledFunction"]


class CompiledFunction:
    def __init__(self, function: SglFunction, backend: Any = None) -> None:
        self.function = function
        self.root = function.trace(backend=backend)
        self.backend = self.root.backend
        self.nodes: list[tuple[TracerState, Any]] = []
        self.order = self._build()

    def _build(self) -> list[int]:
        deps: dict[int, set[int]] = {}
        last: dict[int, int] = {}  # stream id -> its last node
        producers: dict[tuple[int, str], int] = {}
        pending: list[tuple[TracerState, int | None]] = [(self.root, None)]
        while pending:
            state, after = pending.pop(0)
            previous = after
            for item in state.items:
                index = len(self.nodes)
                self.nodes.append((state, item))
                deps[index] = {previous} if previous is not None else set()
                if isinstance(item, (Gen, Select)) and item.name is not None:
                    producers[(state.id, item.name)] = index
                elif isinstance(item, ForkOp):
                    pending.extend((child, index) for child in item.children)
                previous = index
            if previous is not None:
                last[state.id] = previous
        for index, (state, item) in enumerate(self.nodes):
            if isinstance(item, JoinOp):
                deps[index] |= {last[c.id] for c in item.children if c.id in last}
            elif isinstance(item, Variable) and isinstance(item.source, TracerState) \
                    and item.source is not state:
                producer = producers.get((item.source.id, item.name))
                if producer is None:
                    raise LangError(f"unknown variable {item.name!r} read from another branch")
                deps[index].add(producer)
        # Kahn's algorithm, lowest index first among the ready nodes
        users: dict[int, list[int]] = {i: [] for i in deps}
        for i, ds in deps.items():
            for d in ds:
                users[d].append(i)
        remaining = {i: len(ds) for i, ds in deps.items()}
        ready = [i for i, n in remaining.items() if n == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                remaining[u] -= 1
                if remaining[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != len(self.nodes):
            raise LangError("the traced program has a dependency cycle")
        return order

    def run(self, *, backend: Any = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the graph with the program's arguments (by name)."""
        names = self.function.arg_names
        missing = [n for n in names if n not in kwargs and n not in self.function.bound]
        if missing:
            raise TypeError(f"compiled program missing argument(s): {', '.join(missing)}")
        arguments = {**self.function.bound, **kwargs}
        main = StreamExecutor(backend or self.backend, arguments, None, stream)
        executors = {self.root.id: main}
        for index in self.order:
            state, item = self.nodes[index]
            executor = executors[state.id]
            if isinstance(item, ForkOp):
                for child, forked in zip(item.children, executor.fork(len(item.children))):
                    executors[child.id] = forked
            elif isinstance(item, JoinOp):
                ProgramStateGroup([ProgramState(executors[c.id]) for c in item.children],
                                  ProgramState(executor)).join(item.mode)
            elif isinstance(item, Argument):
                executor.submit(ConstantText(str(arguments[item.name])))
            elif isinstance(item, Variable) and isinstance(item.source, TracerState):
                executor.submit(Variable(item.name, executors[item.source.id]))
            else:
                executor.submit(item)
        main.end()
        state = ProgramState(main)
        if not stream:
            state.sync()
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None,
                  num_threads: int | str = "auto") -> list[ProgramState]:
        from concurrent.futures import ThreadPoolExecutor

        workers = min(len(batch_kwargs), 64) if num_threads == "auto" else int(num_threads)
        with ThreadPoolExecutor(max(1, workers)) as pool:
            return list(pool.map(lambda kw: self.run(backend=backend, **kw), batch_kwargs))

    def print_graph(self) -> str:
        lines = []
        for index in self.order:
            state, item = self.nodes[index]
            lines.append(f"{index:3d} stream {state.id}: {item!r}")
        return "\n".join(lines)
