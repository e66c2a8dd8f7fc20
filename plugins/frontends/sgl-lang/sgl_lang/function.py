"""``@function``: a program, with ``run``, ``run_batch``, ``trace`` and ``compile``."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sgl_lang.api import as_backend, get_default_backend
from sgl_lang.interpreter import ProgramState, StreamExecutor
from sgl_lang.ir import Argument, SamplingParams
from sgl_lang.tracer import TracerState, extract_prefix

__all__ = ["SglFunction", "function"]

logger = logging.getLogger("sgl.lang")

#: a traced prefix shorter than this (in characters) is not worth a warm-up request
MIN_PREFIX_CHARS = 64


def function(func: Callable[..., Any] | None = None, *,
             num_api_spec_tokens: int | None = None) -> Any:
    """Make ``func(s, ...)`` a program. Use as ``@function`` or ``@function(...)``."""
    if func is None:
        return lambda f: SglFunction(f)
    return SglFunction(func)


class SglFunction:
    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@function {func.__name__}: the first argument must be the "
                            f"program state (s)")
        self.func = func
        self.arg_names = params[1:]
        self.bound = dict(bound or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy of the program with some arguments fixed."""
        return SglFunction(self.func, {**self.bound, **kwargs})

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = inspect.signature(self.func).bind(None, *args, **{**self.bound, **kwargs})
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(inspect.signature(self.func).parameters)))
        return arguments

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # called on a state inside another program: append this one in place
        if args and isinstance(args[0], (ProgramState, TracerState)):
            return self.func(*args, **{**self.bound, **kwargs})
        return self.run(*args, **kwargs)

    def run(self, *args: Any, max_new_tokens: int | None = 128,
            stop: str | list[str] | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
            stop_token_ids: list[int] | None = None,
            frequency_penalty: float | None = None, presence_penalty: float | None = None,
            ignore_eos: bool | None = None, stream: bool = False, backend: Any = None,
            use_thread: bool = True, **kwargs: Any) -> ProgramState:
        """Run the program; the sampling arguments are defaults for every ``gen`` that does not
        set them. With ``stream=True`` it returns at once; read ``state.text_iter()``.
        ``use_thread`` is accepted for SGLang's signature: every state has its worker thread."""
        defaults = SamplingParams(max_new_tokens=max_new_tokens, stop=stop,
                                  temperature=temperature, top_p=top_p, top_k=top_k,
                                  min_p=min_p, stop_token_ids=stop_token_ids,
                                  frequency_penalty=frequency_penalty,
                                  presence_penalty=presence_penalty, ignore_eos=ignore_eos)
        arguments = self._arguments(args, kwargs)
        backend = as_backend(backend) or get_default_backend()
        executor = StreamExecutor(backend, arguments, defaults, stream)
        state = ProgramState(executor)
        try:
            self.func(state, **arguments)
        finally:
            executor.end()
        if not stream:
            state.sync()
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  generator_style: bool = False, warmup: bool = True,
                  **run_kwargs: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per dict of arguments on a thread pool; the results keep the
        order of ``batch_kwargs``. The program's traced constant prefix is sent once first, so
        every instance finds it in the prefix cache. ``generator_style=True`` yields the states
        in order as they complete instead of returning a list."""
        backend = as_backend(backend) or get_default_backend()
        batch_kwargs = list(batch_kwargs)
        if warmup and len(batch_kwargs) > 1:
            self.warmup(backend)
        workers = min(len(batch_kwargs), 64) if num_threads == "auto" else int(num_threads)
        gen = self._run_batch(batch_kwargs, backend, max(1, workers), progress_bar, run_kwargs)
        return gen if generator_style else list(gen)

    def _run_batch(self, batch_kwargs: list[dict[str, Any]], backend: Any, workers: int,
                   progress_bar: bool, run_kwargs: dict[str, Any]) -> Iterator[ProgramState]:
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.__name__)
        with ThreadPoolExecutor(workers, thread_name_prefix="sgl-lang-batch") as pool:
            futures = [pool.submit(self.run, backend=backend, **run_kwargs, **kw)
                       for kw in batch_kwargs]
            if bar is not None:
                for future in futures:
                    future.add_done_callback(lambda _: bar.update(1))
            try:
                for future in futures:
                    yield future.result()
            finally:
                if bar is not None:
                    bar.close()

    def trace(self, *, backend: Any = None, **kwargs: Any) -> TracerState:
        """Run the program with placeholders for the arguments not given, recording its
        expressions without generating anything."""
        state = TracerState(as_backend(backend) or get_default_backend())
        arguments = {name: kwargs.get(name, self.bound.get(name, Argument(name)))
                     for name in self.arg_names}
        self.func(state, **arguments)
        return state

    def prefix(self, backend: Any = None) -> str:
        """The constant text every run starts with ('' when tracing fails)."""
        try:
            return extract_prefix(self.trace(backend=backend))
        except Exception as exc:  # control flow on argument values cannot be traced
            logger.debug("cannot trace %s: %s", self.__name__, exc)
            return ""

    def warmup(self, backend: Any = None) -> int | None:
        """Send the traced prefix once (when at least :data:`MIN_PREFIX_CHARS` long) as a
        prefill-only request; return its token count, or None when nothing was sent."""
        backend = as_backend(backend) or get_default_backend()
        prefix = self.prefix(backend)
        if backend is None or len(prefix) < MIN_PREFIX_CHARS:
            return None
        return backend.cache_prefix(prefix)

    def compile(self, *, backend: Any = None) -> Any:
        """The traced graph of the program, ordered topologically (:class:`CompiledFunction`)."""
        from sgl_lang.compiler import CompiledFunction

        return CompiledFunction(self, as_backend(backend) or get_default_backend())

    def __repr__(self) -> str:
        return f"<sgl function {self.__name__}({', '.join(self.arg_names)})>"
