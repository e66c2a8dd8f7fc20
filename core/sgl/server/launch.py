"""``sgl serve``: start the scheduler, build the app, run uvicorn, clean up."""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from sgl.engine.launch import SchedulerStartError, start_scheduler
from sgl.log import setup_logging

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.plugins import SglPluginManager

__all__ = ["check_port", "run_server"]

logger = logging.getLogger("sgl.server")


class _Server(uvicorn.Server):
    """uvicorn's server, plus the one line that says sgl is ready, and SIGINT/SIGTERM treated
    as a request for a clean shutdown (exit 0) rather than re-raised after it."""

    ready_message = ""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.info("%s received: no new connections; waiting up to %.0f s for in-flight "
                        "requests, then aborting them", signal.Signals(sig).name,
                        self.config.timeout_graceful_shutdown or 0)
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            logger.info("%s", self.ready_message)


def check_port(host: str, port: int) -> str | None:
    """Why nothing could listen on ``host:port`` (a message naming --host/--port), or None."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use; choose another with --port"
            return f"cannot listen on {host}:{port}: {exc.strerror}; check --host and --port"
    return None


def run_server(settings: ServerSettings, pm: SglPluginManager) -> int:
    """Serve until interrupted; return the process exit code."""
    from sgl.model_loader import load_tokenizer, resolve_model_path
    from sgl.server.app import create_app
    from sgl.server.context import ServerContext
    from sgl.grammar.select import GrammarChecker
    from sgl.server.tokenizer_manager import TokenizerManager

    setup_logging(settings.log_level, process="server")
    if settings.node_rank > 0:
        return run_ranks_only(settings, pm)
    problem = check_port(settings.host, settings.port)
    if problem:
        logger.error("%s", problem)
        return 2
    for record in pm.records.values():
        if record.available:
            logger.info("plugin %s (%s) loaded", record.name, record.distribution or record.source)
        else:
            logger.warning("plugin %s unavailable: %s", record.name, record.reason)

    try:
        model_path = resolve_model_path(settings.model_path)
    except Exception as exc:
        logger.error("%s", exc)
        return 2
    logger.info("model %s; starting the scheduler process", model_path)
    handle = start_scheduler(settings, pm)
    try:
        tokenizer = load_tokenizer(model_path)
        info = handle.wait_ready()
    except (SchedulerStartError, Exception) as exc:
        logger.error("%s", exc)
        handle.stop(timeout=1)
        return 1
    mib = info.kv_pool_bytes / 2**20
    logger.info("model %s (%s), dtype %s, %d torch thread(s) + %d kernel thread(s), CPU "
                "kernels %s, attention %s", info.architecture, info.model_path, info.dtype,
                info.num_threads, info.kernel_threads, info.cpu_isa or "not used",
                info.attention_backend)
    logger.info("weights: %.1f MiB (quantization %s); KV pool: %d tokens (%.0f MiB), context "
                "length %d", info.weights_bytes / 2**20, info.quantization,
                info.max_total_tokens, mib, info.context_length)

    tm = TokenizerManager(tokenizer, handle.endpoints, info, settings,
                          grammar=GrammarChecker.for_server(pm, info.grammar_backend),
                          router=handle.router)
    ctx = ServerContext(settings=settings, plugin_manager=pm, scheduler=handle, info=info,
                        tokenizer_manager=tm)
    try:
        app = create_app(ctx)
        pm.notify_startup(settings=settings, process="server", context=ctx)
    except Exception as exc:  # a plugin's router or start-up hook failed
        logger.error("%s", exc)
        handle.stop(timeout=0)
        return 1
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.graceful_shutdown_timeout)
    server = _Server(config)
    server.ready_message = (f"sgl is ready: serving {ctx.model_name} at "
                            f"http://{settings.host}:{settings.port}")
    ctx.uvicorn_server = server
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled; the shutdown was clean
        pass
    finally:
        handle.stop()
        pm.notify_shutdown(settings=settings, process="server")
    if not server.started and ctx.exit_code == 0:
        return 1
    return ctx.exit_code


def run_ranks_only(settings: ServerSettings, pm: SglPluginManager) -> int:
    """``sgl serve --node-rank K`` (K > 0): run this node's ranks, no HTTP server, until they
    stop (node 0's leader stops them) or the process is interrupted."""
    logger.info("node %d of %d: starting this node's ranks; node 0 (%s) serves HTTP",
                settings.node_rank, settings.nnodes, settings.dist_init_addr)
    handle = start_scheduler(settings, pm)
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        handle.wait_ready(timeout=settings.dist_timeout + 900)
        logger.info("node %d is ready: its ranks follow node 0", settings.node_rank)
        while handle.alive and not stopping.is_set():
            stopping.wait(0.5)
    except SchedulerStartError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        handle.stop(timeout=0 if stopping.is_set() else 10)
    if stopping.is_set():
        return 0
    codes = [p.exitcode for p in handle.processes]
    if any(codes):
        logger.error("%s", handle.death_reason())
        return 1
    logger.info("node 0 stopped the ranks of node %d", settings.node_rank)
    return 0
