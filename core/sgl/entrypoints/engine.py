"""``sgl.Engine``: the runtime in your own Python process, without HTTP.

The engine starts the same scheduler process as ``sgl serve`` and runs a
:class:`~sgl.server.tokenizer_manager.TokenizerManager` on an asyncio loop in a background
thread. Its methods follow SGLang's ``Engine``::

    import sgl

    with sgl.Engine(max_total_tokens=4096) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        print(out["text"], out["meta_info"]["finish_reason"])

The scheduler is a ``spawn``-ed process, so a script that creates an engine at import time must
guard it with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import difflib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from sgl.server.io_struct import BadRequestError, GenerateError, GenerateReqInput

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.launch import SchedulerHandle
    from sgl.engine.messages import SchedulerInfo
    from sgl.plugins import SglPluginManager
    from sgl.sampling import SamplingParams
    from sgl.server.tokenizer_manager import TokenizerManager

__all__ = ["BadRequestError", "Engine", "EngineClosedError", "GenerateError", "engine_settings"]

logger = logging.getLogger("sgl.engine")

T = TypeVar("T")
SOURCE = "Engine(...)"
#: how often the engine checks that the scheduler process is alive
WATCH_INTERVAL = 0.2


class EngineClosedError(RuntimeError):
    """The engine was shut down; create a new one."""


def engine_settings(model_path: str | None, settings: dict[str, Any],
                    plugin_classes: dict[str, type] | None = None) -> ServerSettings:
    """Settings from ``Engine(...)`` keyword arguments: options by their top-level names
    (:class:`~sgl.config.ServerSettings` fields, and plugin options such as
    ``disaggregation_mode``), and ``plugins``: plugin id -> its options, as a config file's
    ``[plugins.<id>]`` tables. ``SGL_*`` variables and config files are not read. Without
    ``plugin_classes`` (before the plugins are loaded) only the core's settings are read.

    :raises TypeError: for a name that is not a setting (the message lists the valid ones).
    :raises sgl.config.ConfigError: (a ``ValueError``) for a bad value, naming the setting.
    """
    from sgl.config import ServerSettings, load_settings, option_fields, plugin_options

    core = [f.name for f in option_fields(ServerSettings)]
    named = plugin_options(plugin_classes or {})
    values = dict(settings)
    plugins = values.pop("plugins", None)
    if plugin_classes is None:
        values = {name: value for name, value in values.items() if name in core}
    valid = core + list(named) + ["plugins"]
    unknown = [name for name in values if name not in valid]
    if unknown:
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"Engine() got unknown setting(s) {', '.join(map(repr, unknown))}{hint} "
                        f"(valid settings: {', '.join(valid)})")
    plugin_cli: dict[str, dict[str, Any]] = {}
    for name in [name for name in values if name in named]:
        pid, f = named[name]
        plugin_cli.setdefault(pid, {})[f.name] = values.pop(name)
    if model_path is not None:
        values["model_path"] = str(model_path)
    tables = {"plugins": plugins} if plugins and plugin_classes is not None else None
    return load_settings(cli=values, plugin_cli=plugin_cli, env={}, file_data=tables,
                         plugin_classes=plugin_classes, cli_source=SOURCE)


async def _next_or_done(agen: AsyncIterator[T]) -> tuple[bool, T | None]:
    try:
        return False, await agen.__anext__()
    except StopAsyncIteration:
        return True, None


class Engine:
    """The sgl runtime in this process: a scheduler process plus a tokenizer manager.

    :param model_path: a Hugging Face model folder or ``.gguf`` file; default: the bundled
        SmolLM2-135M-Instruct.
    :param settings: any :class:`~sgl.config.ServerSettings` field by name, e.g.
        ``dtype="float32"``, ``max_total_tokens=4096``, ``chat_template="chat.jinja"``, and
        ``plugins={"speculative-ngram": {"max_bfs_breadth": 3}}`` for plugins' options.
    """

    def __init__(self, model_path: str | None = None, **settings: Any) -> None:
        self._closed = True  # until start-up succeeded; makes __del__ and shutdown() safe
        from sgl.engine.launch import start_scheduler
        from sgl.config import ConfigError
        from sgl.parallel.select import parallel_strategy
        from sgl.model_loader import load_tokenizer, resolve_model_path
        from sgl.plugins import PluginSelection, create_plugin_manager
        from sgl.grammar.select import GrammarChecker
        from sgl.server.tokenizer_manager import TokenizerManager

        base = engine_settings(model_path, settings)  # unknown names fail before any work
        pm = create_plugin_manager(PluginSelection.from_args(base.load_plugins,
                                                             base.disable_plugins))
        self.settings: ServerSettings = engine_settings(model_path, settings,
                                                        pm.config_classes())
        self.plugin_manager: SglPluginManager = pm
        pm.check_backends(self.settings)
        parallel_strategy(self.settings, pm.registries)
        if self.settings.node_rank > 0:
            raise ConfigError("sgl.Engine runs node 0 of --nnodes; start the other nodes with "
                              "`sgl serve --node-rank K` and the same settings")
        resolved = resolve_model_path(self.settings.model_path)
        self._handle: SchedulerHandle = start_scheduler(self.settings, pm)
        try:
            self.tokenizer = load_tokenizer(resolved)
            self.info: SchedulerInfo = self._handle.wait_ready()
        except BaseException:
            self._handle.stop(timeout=1)
            raise
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sgl-engine-loop",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.tokenizer_manager: TokenizerManager = TokenizerManager(
                self.tokenizer, self._handle.endpoints, self.info, self.settings,
                grammar=GrammarChecker.for_server(pm, self.info.grammar_backend),
                router=self._handle.router)
            self._run(self._start())
            pm.notify_startup(settings=self.settings, process="engine", context=self)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    # --- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | list[Any] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        session_id: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict ``{"text", "output_ids", "meta_info"}``), a list of
        prompts or of token-id lists (a list of dicts), or ``n > 1`` samples (a list).

        With ``stream=True``, an iterator of chunks that each hold only the new text and ids;
        for a batch or ``n > 1`` every chunk has an ``"index"``. Bad input raises
        :class:`BadRequestError` (a ``ValueError``) at once; a failed request raises
        :class:`GenerateError`. ``session_id`` (from :meth:`open_session`) keeps the
        conversation cached for the session's next request.
        """
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs, stream=stream,
            session_params={"id": session_id} if session_id is not None else None)
        if stream:
            return self._iterate(self._run(self._open_stream(obj)))
        return self._run(self.tokenizer_manager.generate(obj))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | list[Any] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        session_id: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """:meth:`generate` for asyncio code, from any event loop. With ``stream=True`` the
        awaited value is an async iterator of chunks. Cancelling the awaiting task aborts the
        request."""
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs, stream=stream,
            session_params={"id": session_id} if session_id is not None else None)
        if stream:
            return self._aiterate(await self._arun(self._open_stream(obj)))
        return await self._arun(self.tokenizer_manager.generate(obj))

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: dict[str, Any] | SamplingParams | list[Any] | None = None,
             **kwargs: Any) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate the assistant's reply to a conversation (a list of ``{"role", "content"}``
        messages) formatted with the chat template, or to a list of conversations. Other
        keyword arguments are those of :meth:`generate`."""
        if "prompt" in kwargs or "input_ids" in kwargs:
            raise TypeError("chat() takes messages, not prompt or input_ids")
        return self.generate(input_ids=self.apply_chat_template(messages),
                             sampling_params=sampling_params, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]]
                            ) -> list[int] | list[list[int]]:
        """The token ids :meth:`chat` sends for ``messages`` (one list per conversation)."""
        return self._run(self._template(messages))

    # --- control --------------------------------------------------------------------------------

    def flush_cache(self) -> dict[str, Any]:
        """Drop cached prefixes in the scheduler; returns its answer (``success``, ...)."""
        return self._run(self.tokenizer_manager.flush_cache())

    def open_session(self, session_id: str | None = None) -> str:
        """Open a session (a conversation kept in the prefix cache between its requests);
        returns its id. See ``docs/cache.md``."""
        return self._run(self.tokenizer_manager.open_session(session_id))

    def close_session(self, session_id: str) -> None:
        """Close a session opened with :meth:`open_session`."""
        self._run(self.tokenizer_manager.close_session(session_id))

    def get_server_info(self) -> dict[str, Any]:
        """Settings, the model's facts and the scheduler's live state (SGLang's shape)."""
        return self._run(self.tokenizer_manager.get_server_info())

    @property
    def alive(self) -> bool:
        """Whether the engine can take requests (not shut down, scheduler running)."""
        return not self._closed and self._handle.alive

    def shutdown(self) -> None:
        """Stop the scheduler process and the background loop. Safe to call more than once;
        also called at interpreter exit and when the engine is garbage-collected."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        try:
            if loop.is_running():
                future = asyncio.run_coroutine_threadsafe(self._stop(), loop)
                try:
                    future.result(timeout=10)
                except Exception:  # noqa: BLE001 - shutting down regardless
                    logger.exception("error while stopping the tokenizer manager")
                loop.call_soon_threadsafe(loop.stop)
                self._thread.join(timeout=10)
            if not loop.is_running():
                loop.close()
        finally:
            self._handle.stop()
            self.plugin_manager.notify_shutdown(settings=self.settings, process="engine")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - nothing sensible to do in a finalizer
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        model = getattr(getattr(self, "info", None), "model_path", "?")
        return f"<sgl.Engine {model} {state}>"

    # --- plumbing -------------------------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise EngineClosedError("this sgl.Engine has been shut down; create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine's loop and wait for it (from a non-loop thread)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking sgl.Engine method was called from the engine's own "
                               "event loop; use async_generate there")
        future = self._submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt: abort the request in the loop too
            raise

    async def _arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine's loop and await it from the caller's loop."""
        return await asyncio.wrap_future(self._submit(coro))

    async def _open_stream(self, obj: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        return await self.tokenizer_manager.generate_stream(obj)

    async def _template(self, messages: Any) -> list[int] | list[list[int]]:
        tm = self.tokenizer_manager
        if isinstance(messages, list) and messages and isinstance(messages[0], list):
            return [await tm.in_tokenizer_thread(tm.apply_chat_template, m) for m in messages]
        return await tm.in_tokenizer_thread(tm.apply_chat_template, messages)

    def _iterate(self, agen: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        done = False
        try:
            while True:
                done, chunk = self._run(_next_or_done(agen))
                if done:
                    return
                yield chunk  # type: ignore[misc]
        finally:
            if not done and not self._closed:  # stopped early: abort the request
                self._run(agen.aclose())  # type: ignore[attr-defined]

    async def _aiterate(self, agen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        done = False
        try:
            while True:
                done, chunk = await self._arun(_next_or_done(agen))
                if done:
                    return
                yield chunk  # type: ignore[misc]
        finally:
            if not done and not self._closed:
                await self._arun(agen.aclose())  # type: ignore[attr-defined]

    async def _start(self) -> None:
        await self.tokenizer_manager.start()
        self._watchdog = asyncio.create_task(self._watch(), name="sgl-engine-watchdog")

    async def _stop(self) -> None:
        self._watchdog.cancel()
        try:
            await self._watchdog
        except asyncio.CancelledError:
            pass
        await self.tokenizer_manager.stop()

    async def _watch(self) -> None:
        """Fail pending and future calls once the scheduler process is gone."""
        while self._handle.alive:
            await asyncio.sleep(WATCH_INTERVAL)
        reason = (f"{self._handle.death_reason()}; this sgl.Engine cannot run requests any "
                  "more, create a new one")
        if self.tokenizer_manager.dead_reason is None:
            logger.error("%s", reason)
            self.tokenizer_manager.fail_all(reason)


def _shutdown_at_exit(ref: weakref.ReferenceType[Engine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
