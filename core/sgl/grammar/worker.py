"""Compiling constraints in child processes, bounded in time and memory.

A constraint is text from a client, and some constraints cost exponential time or memory to
compile: the regular expression ``[ab]*a[ab]{30}`` has a deterministic automaton of 2^30 states,
which outlines-core builds in full. A thread cannot be stopped and shares the scheduler's memory,
so every compile runs in a *compile worker*, a child process (``python -m sgl.grammar.worker``)
with its own copy of the grammar backend that compiles one constraint at a time:

- its address space is capped at what it holds after start-up plus
  ``--grammar-compile-memory-mb`` (an allocation past that fails inside the worker, never in the
  scheduler);
- a compile that runs past ``--grammar-compile-timeout`` seconds gets the worker killed;
- either way the constraint is refused with status 400 naming the setting, and the next compile
  starts a fresh worker.

The compiled grammar comes back as bytes (:meth:`BaseGrammarBackend.serialize`) and is rebuilt in
the scheduler (:meth:`BaseGrammarBackend.deserialize`), where the matchers run. Workers start on
the first constraint (a server that never sees one runs none) and stay for the next.

Messages are pickles with an 8-byte length, over the child's stdin and a private copy of its
stdout (the child's fd 1 then points at its stderr, so a library that prints cannot corrupt the
stream). The child exits when the scheduler closes the pipe or dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from sgl.grammar.base import BaseGrammarBackend, GrammarError

__all__ = ["BackendRecipe", "CompileWorkers"]

logger = logging.getLogger("sgl.grammar")

#: seconds a new worker may take to import its backend and build it from the tokenizer
START_TIMEOUT = 300.0
_HEADER = struct.Struct("<Q")


@dataclass
class BackendRecipe:
    """What a compile worker needs to build its own copy of the backend (pickled to it; the
    class by reference, so it must be importable in a fresh process)."""

    cls: type[BaseGrammarBackend]
    tokenizer: Any
    vocab_size: int
    stop_token_ids: list[int] = field(default_factory=list)

    def build(self) -> BaseGrammarBackend:
        return self.cls(tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                        stop_token_ids=self.stop_token_ids)


class WorkerLost(Exception):
    """The worker was killed (deadline) or died (memory limit, crash): the message says which."""


def _write(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(fd: int, deadline: float | None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


class CompileWorker:
    """One child process; :meth:`compile` is called by one thread at a time."""

    def __init__(self, recipe: bytes, memory_bytes: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sgl.grammar.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin, self._fd = self.process.stdin, self.process.stdout.fileno()
        self._ready = False
        # written from a thread: the pipe holds 64 KiB, and the child reads the recipe (the
        # tokenizer, megabytes) only once it has started, which the caller need not wait for
        self._sending = threading.Thread(target=self._send_recipe, name="sgl-grammar-recipe",
                                         args=((sys.path, recipe, memory_bytes),), daemon=True)
        self._sending.start()

    def _send_recipe(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError, ValueError):  # the child died: _wait_ready says so
            _write(self._stdin, message)

    def _wait_ready(self) -> None:
        if self._ready:
            return
        try:
            status, detail = _read(self._fd, time.monotonic() + START_TIMEOUT)
        except (EOFError, TimeoutError) as exc:
            self.kill()
            raise RuntimeError(f"the grammar compile worker did not start ({self._fate(exc)})"
                               ) from None
        if status != "ready":
            self.kill()
            raise RuntimeError(f"the grammar compile worker could not build its backend: {detail}")
        self._sending.join()
        self._ready = True

    def compile(self, kind: str, spec: str, timeout: float) -> bytes:
        """The serialized compiled grammar; GrammarError for an invalid constraint, WorkerLost
        (the worker is then gone) for one past the limits, RuntimeError for a backend failure."""
        self._wait_ready()
        try:
            _write(self._stdin, (kind, spec))
            status, detail = _read(self._fd, time.monotonic() + timeout)
        except TimeoutError:
            self.kill()
            raise WorkerLost("timeout") from None
        except (EOFError, BrokenPipeError):
            self.kill()
            raise WorkerLost(self._fate(None)) from None
        if status == "ok":
            return detail
        if status == "invalid":
            raise GrammarError(kind, detail)
        if status == "memory":
            raise WorkerLost("memory")
        raise RuntimeError(detail)

    def _fate(self, exc: BaseException | None) -> str:
        if isinstance(exc, TimeoutError):
            return f"no answer in {START_TIMEOUT:.0f} s"
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        code = self.process.returncode
        return "memory" if code in (-6, -9, 134, 137) else f"exit code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]

    def alive(self) -> bool:
        return self.process.poll() is None


class CompileWorkers:
    """Up to ``size`` compile workers, started on demand and shared by the compiling threads.

    ``recipe`` is called once, on the first compile (it waits for the tokenizer)."""

    def __init__(self, recipe: Any, *, size: int, timeout: float, memory_mb: int,
                 backend_name: str) -> None:
        self._make_recipe = recipe
        self._recipe: bytes | None = None
        self.size, self.timeout, self.memory_mb = size, timeout, memory_mb
        self.backend_name = backend_name
        self._idle: list[CompileWorker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # workers started (a killed worker is replaced by a new one)
        self.lost = 0  # workers killed at the deadline or lost to the memory cap

    def compile(self, kind: str, spec: str) -> bytes:
        """Compile in a worker (the caller's thread waits); the limits' errors name the flags."""
        worker = self._checkout()
        try:
            data = worker.compile(kind, spec, self.timeout)
        except WorkerLost as exc:
            self.lost += 1
            logger.warning("grammar compile worker %s (%s: %s)",
                           "killed at the deadline" if str(exc) == "timeout" else "lost",
                           kind, str(exc))
            self._replace()
            raise GrammarError(kind, self._limit_message(str(exc))) from None
        except BaseException:
            if worker.alive():
                self._checkin(worker)
            raise
        self._checkin(worker)
        return data

    def _limit_message(self, fate: str) -> str:
        if fate == "timeout":
            return (f"compiling it took longer than {self.timeout:g} s "
                    "(--grammar-compile-timeout); simplify the constraint")
        if fate == "memory":
            return (f"compiling it needs more than {self.memory_mb} MiB "
                    "(--grammar-compile-memory-mb); simplify the constraint")
        return f"the {self.backend_name} grammar compiler died on it ({fate})"

    def _checkout(self) -> CompileWorker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar manager is closed")
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
            if self._recipe is None:
                self._recipe = pickle.dumps(self._make_recipe(),
                                            protocol=pickle.HIGHEST_PROTOCOL)
            self.started += 1
            return CompileWorker(self._recipe, self.memory_mb << 20)

    def _replace(self) -> None:
        """Start a worker for the one just lost, so the next constraint need not wait for it."""
        with self._lock:
            if not self._closed and self._recipe is not None and len(self._idle) < self.size:
                self.started += 1
                self._idle.append(CompileWorker(self._recipe, self.memory_mb << 20))

    def _checkin(self, worker: CompileWorker) -> None:
        with self._lock:
            if self._closed or len(self._idle) >= self.size:
                worker.kill()
            else:
                self._idle.append(worker)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


# the child ------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _limit_memory(extra: int) -> None:
    """Cap the address space at what the process maps now plus ``extra`` bytes."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + extra
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError) as exc:  # not Linux: the deadline still holds
        logger.warning("grammar compile worker: no memory cap (%s)", exc)


def _serve() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the message stream
    sys.stdout = sys.stderr
    fd = sys.stdin.fileno()
    path, recipe, memory = _read(fd, None)
    sys.path[:] = path
    try:
        backend = pickle.loads(recipe).build()
    except Exception as exc:
        _write(out, ("error", f"{type(exc).__name__}: {exc}"))
        return
    _limit_memory(memory)
    _write(out, ("ready", None))
    while True:
        try:
            kind, spec = _read(fd, None)
        except EOFError:
            return
        try:
            reply = ("ok", backend.serialize(backend.compile(kind, spec)))
        except GrammarError as exc:
            reply = ("invalid", str(exc).removeprefix(f"invalid {kind}: "))
        except MemoryError:
            reply = ("memory", "")
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            reply = ("memory", "") if "bad_alloc" in text else ("failed", text)
        _write(out, reply)


if __name__ == "__main__":
    _serve()
