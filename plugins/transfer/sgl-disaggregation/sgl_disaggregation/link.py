"""The thread each disaggregated scheduler talks to its peers through.

The scheduler never waits on a peer: it hands commands to its :class:`Link` thread and picks
up the link's events between forwards. Events also wake a scheduler that waits idle for
messages (:attr:`Link.wake` is a socket it polls beside its request socket).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from sgl.transfer import BaseKVTransfer, KVBuffers
from sgl_disaggregation.bootstrap import advertised_host
from sgl_disaggregation.settings import options_of

if TYPE_CHECKING:
    from sgl.engine.extension import SchedulerView

__all__ = ["MAX_MESSAGE_BYTES", "Link", "LinkCodec", "peer_socket", "request_error",
           "room_of", "transfer_backend"]

logger = logging.getLogger("sgl.disaggregation")

#: how often the link thread looks at its deadlines when no message comes
TICK_S = 0.25
#: the largest message a peer may send on a link socket (ZMQ drops the peer past it); a want
#: of a prompt at a 1M-token context is about 8 MB
MAX_MESSAGE_BYTES = 32 * 2**20


def transfer_backend(scheduler: SchedulerView) -> BaseKVTransfer:
    """The ``--disaggregation-transfer-backend`` plugin's backend over the scheduler's KV pool,
    in this server's role."""
    opts = options_of(scheduler.settings)
    cls = scheduler.plugins.registries.transfer.load(opts.transfer_backend)
    pool = scheduler.runner.kv_pool
    return cls(KVBuffers([*pool.k_buffer, *pool.v_buffer]), role=opts.mode,
               host=advertised_host(scheduler.settings.host))


def request_error(req: Any, mode: str) -> str | None:
    """Why a ``mode`` (prefill or decode) server cannot take ``req`` whatever its room: no
    bootstrap fields, or a session."""
    if req.bootstrap is None:
        return (f"this is a {mode} server (--disaggregation-mode {mode}): a request needs "
                "bootstrap_host, bootstrap_port and bootstrap_room; send it through SGLang's "
                "router in PD mode (sgl router --pd-disaggregation)")
    if req.session_id is not None:
        return "sessions are not supported with --disaggregation-mode"
    return None


def peer_socket(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A socket to the peers, with :data:`MAX_MESSAGE_BYTES` and no linger."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def room_of(msg: Any) -> int:
    """A peer message's room: a JSON integer in [0, 2**64); ``ValueError`` otherwise (a float
    such as ``1e400``, a string, a missing key, a message that is not an object)."""
    room = msg.get("room") if isinstance(msg, dict) else None
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**64:
        raise ValueError(f"bad room {room!r}")
    return room


class LinkCodec:
    """How the peers' messages go on the wire: JSON objects, and with a shared secret
    (``--disaggregation-secret``) inside an envelope ``{"mac": HMAC-SHA256 of the body, "body":
    the JSON text}``, so that a peer without the secret can neither make nor alter one.

    :meth:`loads` reads both forms (a server without the secret reads an envelope's body
    unchecked, so a mismatch is reported, not silent) and says whether the message was
    authenticated; each side refuses what must be authenticated when it has the secret
    (:attr:`required`)."""

    #: what the MAC covers besides the body: messages of other protocols never verify
    DOMAIN = b"sgl-disaggregation-link-v1\n"

    def __init__(self, secret: str | None) -> None:
        self._key = secret.encode() if secret else None

    @property
    def required(self) -> bool:
        return self._key is not None

    def _mac(self, body: bytes) -> str:
        assert self._key is not None
        return hmac.new(self._key, self.DOMAIN + body, hashlib.sha256).hexdigest()

    def dumps(self, msg: dict[str, Any]) -> bytes:
        body = json.dumps(msg, separators=(",", ":")).encode()
        if self._key is None:
            return body
        return json.dumps({"mac": self._mac(body), "body": body.decode()}).encode()

    def loads(self, raw: bytes) -> tuple[dict[str, Any], bool]:
        """The message and whether its MAC is valid; ``ValueError`` for one that is not a JSON
        object (or an envelope whose body is not)."""
        msg = json.loads(raw)
        if not isinstance(msg, dict):
            raise ValueError("not a JSON object")
        if set(msg) != {"mac", "body"} or not isinstance(msg["body"], str):
            return msg, False
        body = msg["body"].encode()
        inner = json.loads(body)
        if not isinstance(inner, dict):
            raise ValueError("not a JSON object")
        valid = (self._key is not None and isinstance(msg["mac"], str)
                 and hmac.compare_digest(msg["mac"], self._mac(body)))
        return inner, valid


_ids = itertools.count()


class Link:
    """A daemon thread with a command socket in and an event socket out (ZMQ inproc, so
    each end stays with one thread). Subclasses implement :meth:`handle_command`,
    :meth:`handle_message` (a message on one of the sockets they :meth:`watch`) and
    :meth:`tick` (deadlines)."""

    def __init__(self, ctx: zmq.Context[Any], backend: BaseKVTransfer, timeout: float,
                 name: str) -> None:
        self.ctx = ctx
        self.backend = backend
        self.timeout = timeout
        n = next(_ids)
        # the scheduler's ends
        self._commands = ctx.socket(zmq.PUSH)
        self.wake = ctx.socket(zmq.PULL)
        self.wake.bind(f"inproc://sgl-link-events-{n}")
        # the thread's ends (created here, used only by the thread once it starts)
        self._command_in = ctx.socket(zmq.PULL)
        self._command_in.bind(f"inproc://sgl-link-commands-{n}")
        self._commands.connect(f"inproc://sgl-link-commands-{n}")
        self._events = ctx.socket(zmq.PUSH)
        self._events.connect(f"inproc://sgl-link-events-{n}")
        self.poller = zmq.Poller()
        self.poller.register(self._command_in, zmq.POLLIN)
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    # the scheduler's side --------------------------------------------------------------------

    def command(self, *cmd: Any) -> bool:
        """Hand ``cmd`` to the thread; never waits. False when the thread is gone (it said so
        with a ``link_failed`` event) and the command was dropped."""
        try:
            self._commands.send_pyobj(cmd, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.error("the disaggregation link is gone: %r dropped", cmd[0])
            return False
        return True

    def events(self) -> list[tuple[Any, ...]]:
        """Every event the thread has sent since the last call."""
        out = []
        while self.wake.poll(0):
            out.append(self.wake.recv_pyobj())
        return out

    def close(self) -> None:
        if self.thread.is_alive():
            self.command("stop")
            self.thread.join(timeout=5)
        self.backend.close()
        for sock in (self._commands, self.wake):
            sock.close(linger=0)

    # the thread's side -----------------------------------------------------------------------

    def emit(self, *event: Any) -> None:
        self._events.send_pyobj(event)

    def watch(self, sock: zmq.Socket[Any]) -> None:
        self.poller.register(sock, zmq.POLLIN)

    def handle_command(self, cmd: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def handle_message(self, sock: zmq.Socket[Any]) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Close the sockets the subclass opened (in the thread)."""

    def _peer_message(self, sock: zmq.Socket[Any]) -> None:
        """A peer's message: one that cannot be handled is logged and dropped, never the end
        of the thread (peers are other servers, or whoever reaches their port)."""
        try:
            self.handle_message(sock)
        except Exception:
            logger.warning("dropped a peer message the link could not handle:\n%s",
                           traceback.format_exc(limit=3))

    def _run(self) -> None:
        try:
            while not self._stopping:
                for sock, _ in self.poller.poll(TICK_S * 1000):
                    if sock is self._command_in:
                        cmd = self._command_in.recv_pyobj()
                        if cmd[0] == "stop":
                            self._stopping = True
                            break
                        self.handle_command(cmd)
                    else:
                        self._peer_message(sock)
                self.tick(time.monotonic())
        except Exception:  # the link is gone: say so, and let the scheduler fail what waits
            logger.error("the disaggregation link stopped:\n%s", traceback.format_exc())
            self.emit("link_failed", traceback.format_exc(limit=1))
        finally:
            self.shutdown()
            self._command_in.close(linger=0)
            self._events.close(linger=0)
