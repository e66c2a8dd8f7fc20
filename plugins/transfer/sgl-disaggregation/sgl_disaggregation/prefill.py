"""The prefill server's side: run the prompt, hand its KV and first token to the decode server.

A request reaches the prefill scheduler with a ``bootstrap_room``. It is prefilled like any
other (chunks, prefix cache) until its first token is sampled; then :class:`PrefillSide` takes
it out of the running batch, keeps its KV slots, and asks the link to send the KV of the
prompt to the decode server that asked for that room. When the write is done (or failed, or
nobody asked within ``--disaggregation-timeout``), the request ends here and its KV goes to
the prefix cache like a finished request's.

The decode server's messages (JSON over a ZMQ ROUTER socket this link binds):

* ``{"type": "want", "room", "dst": [slots], "skip": n, "agent": {...}, "layout": {...}}``:
  write prompt positions ``skip..`` into ``dst`` (the backend's ``local_info`` is ``agent``);
* ``{"type": "cancel", "room"}``: the decode side gave the request up.

Its answers: ``{"type": "done", "room", "token", "logprobs", "bytes", "seconds"}`` once the KV
is there, ``{"type": "failed", "room", "error"}``, or ``{"type": "cancelled", "room"}`` (no
write for that room will come).
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from sgl.engine.extension import SchedulerExtension
from sgl.transfer import BaseKVTransfer, KVTransferError
from sgl_disaggregation.bootstrap import BootstrapServer, advertised_host
from sgl_disaggregation.link import (Link, LinkCodec, peer_socket, request_error, room_of,
                                     transfer_backend)
from sgl_disaggregation.settings import options_of

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.extension import SchedulerView
    from sgl.engine.sequence import Req

__all__ = ["MAX_PENDING_ROOMS", "PrefillLink", "PrefillSide"]

logger = logging.getLogger("sgl.disaggregation")

#: wants (and cancels of rooms not held here) kept at once, each until its request comes or
#: --disaggregation-timeout passes: a bound on what a flood of them can hold
MAX_PENDING_ROOMS = 4096


@dataclass
class _Send:
    """A prefilled request's KV, ready to go: ``slots`` of prompt positions ``0..``."""

    slots: list[int]
    payload: dict[str, Any]
    since: float


@dataclass
class _Want:
    """A decode server's request for a room's KV."""

    identity: bytes
    msg: dict[str, Any]
    since: float


@dataclass
class PrefillStats:
    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    seconds: float = 0.0


class PrefillLink(Link):
    """Matches the scheduler's prefilled requests with the decode servers' wants, by room,
    and runs the writes."""

    def __init__(self, ctx: zmq.Context[Any], backend: BaseKVTransfer, timeout: float,
                 host: str, codec: LinkCodec) -> None:
        super().__init__(ctx, backend, timeout, name="sgl-prefill-link")
        self.codec = codec
        self.router = peer_socket(ctx, zmq.ROUTER)
        port = self.router.bind_to_random_port(f"tcp://{_bind_host(host)}")
        self.endpoint = f"tcp://{_url_host(advertised_host(host))}:{port}"
        self.watch(self.router)
        self.sends: dict[int, _Send] = {}
        self.wants: dict[int, _Want] = {}
        #: rooms that ended here before their decode server asked, and why (with the time)
        self.gone: dict[int, tuple[str, float]] = {}
        #: rooms the decode server gave up before their KV was ready here (with the time)
        self.cancelled: dict[int, float] = {}

    def handle_command(self, cmd: tuple[Any, ...]) -> None:
        kind, room = cmd[0], cmd[1]
        if kind == "send":
            if self.cancelled.pop(room, None) is not None:
                self.emit("failed", room, "the decode server gave the request up", 499)
                return
            self.sends[room] = _Send(cmd[2], cmd[3], time.monotonic())
            self._try(room)
        elif kind == "fail":  # the request ended before its KV was ready
            self.sends.pop(room, None)
            want = self.wants.pop(room, None)
            if want is not None:
                self._reply(want.identity, {"type": "failed", "room": room, "error": cmd[2]})
            else:
                self.gone[room] = (cmd[2], time.monotonic())

    def handle_message(self, sock: zmq.Socket[Any]) -> None:
        frames = self.router.recv_multipart()
        if len(frames) != 2:  # a decode server's DEALER sends one frame (and ROUTER adds one)
            logger.warning("ignored a message of %d frames from a decode server", len(frames))
            return
        identity, raw = frames
        try:
            msg, authentic = self.codec.loads(raw)
            room = room_of(msg)
            kind = msg["type"]
        except (ValueError, KeyError, TypeError):
            logger.warning("ignored a malformed message from a decode server: %r", raw[:200])
            return
        if self.codec.required and not authentic:  # nothing it asks for is done
            logger.warning("refused an unauthenticated %r message for room %d", kind, room)
            self._reply(identity, {"type": "failed", "room": room, "error": (
                "the message is not authenticated: give the prefill and decode servers the "
                "same --disaggregation-secret")})
            return
        if kind == "want":
            if room in self.gone:
                error, _ = self.gone.pop(room)
                self._reply(identity, {"type": "failed", "room": room, "error": error})
                return
            if room not in self.wants and len(self.wants) >= MAX_PENDING_ROOMS:
                self._reply(identity, {"type": "failed", "room": room, "error": (
                    f"this prefill server holds {MAX_PENDING_ROOMS} wants already; retry")})
                return
            self.wants[room] = _Want(identity, msg, time.monotonic())
            self._try(room)
        elif kind == "cancel":
            self.wants.pop(room, None)
            self._reply(identity, {"type": "cancelled", "room": room})
            if room in self.sends:
                del self.sends[room]
                self.emit("failed", room, "the decode server gave the request up", 499)
            else:  # still prefilling here: end it once its KV is ready
                self.cancelled[room] = time.monotonic()
                if len(self.cancelled) > MAX_PENDING_ROOMS:  # the oldest is forgotten
                    del self.cancelled[next(iter(self.cancelled))]

    def tick(self, now: float) -> None:
        for room, send in list(self.sends.items()):
            if now - send.since > self.timeout:
                del self.sends[room]
                self.emit("failed", room, f"no decode server asked for this request's KV "
                          f"(bootstrap_room {room}) within --disaggregation-timeout "
                          f"{self.timeout:g} s", 504)
        for room, want in list(self.wants.items()):
            if now - want.since > self.timeout:
                del self.wants[room]
                self._reply(want.identity, {"type": "failed", "room": room, "error": (
                    f"the prefill server got no request with bootstrap_room {room} within "
                    f"{self.timeout:g} s (was it sent to both servers?)")})
        for room, (_, since) in list(self.gone.items()):
            if now - since > self.timeout:
                del self.gone[room]
        for room, since in list(self.cancelled.items()):
            if now - since > self.timeout:
                del self.cancelled[room]

    def _try(self, room: int) -> None:
        """Run the write for ``room`` once both its KV and the decode server's want are here."""
        if room not in self.sends or room not in self.wants:
            return
        send, want = self.sends.pop(room), self.wants.pop(room)
        msg = want.msg
        try:
            layout = self.backend.buffers.layout()
            if msg.get("layout") != layout:
                raise KVTransferError(f"the decode server's KV layout {msg.get('layout')} "
                                      f"differs from this one's {layout}: serve the same model "
                                      "with the same --dtype on both")
            try:
                skip, dst = int(msg["skip"]), [int(slot) for slot in msg["dst"]]
            except (KeyError, TypeError, ValueError, OverflowError):
                raise KVTransferError("the decode server's request is malformed (its skip "
                                      "and dst)") from None
            if not 0 <= skip <= len(send.slots):
                raise KVTransferError(f"the decode server asked to skip {skip} positions of "
                                      f"{len(send.slots)}")
            src = send.slots[skip:]
            if len(src) != len(dst):
                raise KVTransferError(f"the decode server asked for {len(dst)} positions from "
                                      f"{skip}, the prompt has {len(send.slots)}: do both "
                                      "servers tokenize the same way?")
            start = time.perf_counter()
            nbytes = self.backend.write(msg.get("agent") or {}, room, src, dst, self.timeout)
            seconds = time.perf_counter() - start
        except Exception as exc:  # KVTransferError, or the backend's own on a peer's data
            if not isinstance(exc, KVTransferError):
                logger.warning("the KV transfer of room %d failed:\n%s", room,
                               traceback.format_exc(limit=3))
            self._reply(want.identity, {"type": "failed", "room": room, "error": str(exc)})
            self.emit("failed", room, f"the KV transfer failed: {exc}", 502)
            return
        self._reply(want.identity, {"type": "done", "room": room, "bytes": nbytes,
                                    "seconds": seconds, **send.payload})
        self.emit("sent", room, nbytes, seconds)

    def _reply(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.router.send_multipart([identity, self.codec.dumps(msg)])

    def shutdown(self) -> None:
        self.router.close(linger=0)


class PrefillSide(SchedulerExtension):
    """The prefill scheduler's part (``--disaggregation-mode prefill``): requests with a
    room, handed to the link once their first token is sampled, and ended when the link
    reports."""

    name = "disaggregation-prefill"
    mode = "prefill"
    serves_fields = frozenset({"bootstrap"})
    max_output_tokens = 1  # the first token; the decode server generates the rest
    plain_decode = False  # nothing decodes here

    @classmethod
    def enabled(cls, settings: ServerSettings) -> bool:
        return options_of(settings).mode == "prefill"

    def __init__(self, scheduler: SchedulerView) -> None:
        super().__init__(scheduler)
        settings, opts = scheduler.settings, options_of(scheduler.settings)
        backend = transfer_backend(scheduler)
        self.link = PrefillLink(scheduler.zmq, backend, opts.timeout, settings.host,
                                LinkCodec(opts.secret))
        self.bootstrap = BootstrapServer(
            settings.host, opts.bootstrap_port,
            {"endpoint": self.link.endpoint, "backend": backend.name, "engine_rank": 0,
             "rank_ip": advertised_host(settings.host)})
        self.link.start()
        self.wake = self.link.wake
        #: requests whose KV is with the link, by room
        self.handed: dict[int, Req] = {}
        self.stats = PrefillStats()

    def check(self, req: Req) -> str | None:
        """Why this server cannot take ``req`` (None: it can)."""
        if (error := request_error(req, self.mode)) is not None:
            return error
        room = req.bootstrap.room
        if room in self._rooms_in_use():  # a second one would take the first's place for good
            return f"bootstrap_room {room} is already in use on this prefill server"
        return None

    def _rooms_in_use(self) -> set[int]:
        """The rooms of the requests this server holds: compiling their grammar, waiting,
        running, or handed to the link."""
        held = self.scheduler.held()
        return {r.bootstrap.room for r in held if r.bootstrap is not None} | set(self.handed)

    def after_step(self) -> None:
        """Hand over the requests whose first token was just sampled."""
        s = self.scheduler
        table = s.runner.req_to_token_pool.req_to_token
        for req in s.running:
            if not req.output_ids or req.bootstrap is None or req.error is not None:
                continue
            s.stop_running(req)
            room = req.bootstrap.room
            slots = table[req.row, :len(req.input_ids)].tolist()
            payload = {"token": req.output_ids[0], "logprobs": first_logprobs(req)}
            if not self.link.command("send", room, slots, payload):  # the link is gone
                s.fail(req, "the KV transfer link stopped (see the server log)", 500)
                self._finish(req)
                continue
            self.handed[room] = req

    def ended(self, req: Req, message: str) -> None:
        """``req`` failed or was aborted here before its KV was handed over: tell its decode
        server."""
        if req.bootstrap is not None and req.bootstrap.room not in self.handed:
            self.link.command("fail", req.bootstrap.room, f"the prefill server: {message}")

    def before_step(self) -> list[Req]:
        """Finish the handed-over requests the link reports on (none joins the batch)."""
        s = self.scheduler
        for event in self.link.events():
            if event[0] == "link_failed":
                for req in self.handed.values():
                    s.fail(req, "the KV transfer link stopped (see the server log)", 500)
                    self._finish(req)
                self.handed.clear()
                continue
            req = self.handed.get(event[1])
            if req is None:
                continue
            if event[0] == "sent":
                self.stats.transfers += 1
                self.stats.bytes += event[2]
                self.stats.seconds += event[3]
            else:
                self.stats.failures += 1
                s.fail(req, event[2], event[3])
            del self.handed[event[1]]
            self._finish(req)
        return []

    def _finish(self, req: Req) -> None:
        s = self.scheduler
        if req.finish_reason is None:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        s.free(req)
        s.reply(req)

    def abort(self, rid: str) -> None:
        """Nothing to stop: a request aborted here before its first token is failed (and its
        decode server told) by the scheduler; one already handed over goes on, since its
        decode server still wants the KV."""

    def info(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode, "num_transfer_reqs": len(self.handed),
                "kv_transfers": self.stats.transfers, "kv_transfer_failures": self.stats.failures,
                "kv_transfer_bytes": self.stats.bytes,
                "kv_transfer_seconds": round(self.stats.seconds, 6),
                "bootstrap_endpoint": self.link.endpoint}

    def close(self) -> None:
        self.bootstrap.close()
        self.link.close()


def first_logprobs(req: Req) -> dict[str, Any]:
    """The logprob entries of the first output token (what the decode server reports for it)."""
    if not req.logprobs.return_logprob:
        return {}
    return {"output_token_logprobs": req.output_token_logprobs[:1],
            "output_top_logprobs": req.output_top_logprobs[:1],
            "output_token_ids_logprobs": req.output_token_ids_logprobs[:1]}


def _bind_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "*"
    return _url_host(host)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
