"""The decode server's side: take over a request whose prompt a prefill server runs.

A request reaches the decode scheduler with ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room``. :class:`DecodeSide` queues it until KV memory and a request row are free
(the *bootstrap* queue), then takes its longest cached prefix here (locked: those positions are
not transferred again), allocates slots for the rest of the prompt and asks the prefill server
for them (*transfer*). When the KV and the first token arrive the request joins the running
batch as if it had been prefilled here, and decodes.

A request that fails on the way (the prefill server unreachable, gone, or failing; no KV within
``--disaggregation-timeout``) ends with an error naming why, and its slots are freed. An
aborted one asks the prefill server to stop and keeps its slots until the prefill server
confirms (or the timeout passes): a one-sided backend could still be writing into them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import zmq

from sgl.engine.extension import SchedulerExtension
from sgl.transfer import BaseKVTransfer, KVTransferError
from sgl_disaggregation.bootstrap import is_alive, lookup_route
from sgl_disaggregation.link import (Link, LinkCodec, peer_socket, request_error, room_of,
                                     transfer_backend)
from sgl_disaggregation.settings import options_of, prefill_host_allowed

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.extension import SchedulerView
    from sgl.engine.sequence import Req

__all__ = ["DecodeLink", "DecodeSide"]

logger = logging.getLogger("sgl.disaggregation")

#: seconds between two /health checks of a prefill server the link waits on
HEALTH_EVERY_S = 1.0
#: failed checks in a row after which the prefill server counts as gone
HEALTH_FAILURES = 2


@dataclass
class _Pending:
    host: str
    port: int
    endpoint: str
    since: float
    cancelled: bool = False


class DecodeLink(Link):
    """Sends the wants to the prefill servers' schedulers and reports their answers, watching
    the prefill servers it waits on."""

    def __init__(self, ctx: zmq.Context[Any], backend: BaseKVTransfer, timeout: float,
                 codec: LinkCodec) -> None:
        super().__init__(ctx, backend, timeout, name="sgl-decode-link")
        self.codec = codec
        self.routes: dict[tuple[str, int], str] = {}
        self.dealers: dict[str, zmq.Socket[Any]] = {}
        self.pending: dict[int, _Pending] = {}
        self.health: dict[tuple[str, int], tuple[float, int]] = {}

    def handle_command(self, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "want":
            _, room, host, port, dst, skip = cmd
            try:
                endpoint = self._route(host, port)
            except ConnectionError as exc:
                self.emit("failed", room, str(exc), 502)
                return
            agent = {**self.backend.local_info(), **(self.backend.expect(room, dst) or {})}
            self._send(endpoint, {"type": "want", "room": room, "dst": dst, "skip": skip,
                                  "agent": agent, "layout": self.backend.buffers.layout()})
            self.pending[room] = _Pending(host, port, endpoint, time.monotonic())
        elif cmd[0] == "cancel":
            pending = self.pending.get(cmd[1])
            if pending is not None and not pending.cancelled:
                pending.cancelled, pending.since = True, time.monotonic()
                self._send(pending.endpoint, {"type": "cancel", "room": cmd[1]})
        elif cmd[0] == "abandon":  # a request that ended here before it asked for its KV
            _, room, host, port = cmd
            try:
                self._send(self._route(host, port), {"type": "cancel", "room": room})
            except ConnectionError:
                pass  # that prefill server is not there to hold the KV either

    def handle_message(self, sock: zmq.Socket[Any]) -> None:
        try:
            msg, authentic = self.codec.loads(sock.recv())
            room = room_of(msg)
            kind = msg["type"]
        except (ValueError, KeyError, TypeError):
            logger.warning("ignored a malformed message from a prefill server")
            return
        if kind == "done" and self.codec.required and not authentic:
            kind, msg = "failed", {"error": "its answer is not authenticated: give the prefill "
                                   "and decode servers the same --disaggregation-secret"}
        pending = self.pending.pop(room, None)
        if pending is None:
            return
        self.backend.forget(room)
        if pending.cancelled or kind == "cancelled":
            self.emit("released", room)
        elif kind == "done":
            self.emit("done", room, msg)
        else:
            self.emit("failed", room, f"the prefill server at {pending.host}:{pending.port}: "
                      f"{msg.get('error')}", 502)  # type: ignore[union-attr]

    def tick(self, now: float) -> None:
        for room, pending in list(self.pending.items()):
            if now - pending.since > self.timeout:
                self._drop(room)
                if not pending.cancelled:  # the prefill server may still hold its KV
                    self._send(pending.endpoint, {"type": "cancel", "room": room})
                if pending.cancelled:
                    self.emit("released", room)
                else:
                    self.emit("failed", room, f"no KV from the prefill server at "
                              f"{pending.host}:{pending.port} within --disaggregation-timeout "
                              f"{self.timeout:g} s", 504)
        waited_on = {(p.host, p.port) for p in self.pending.values() if not p.cancelled}
        for peer in list(self.health):
            if peer not in waited_on:
                del self.health[peer]
        for peer in waited_on:
            last, failures = self.health.get(peer, (now, 0))
            if now - last < HEALTH_EVERY_S:
                self.health.setdefault(peer, (last, failures))
                continue
            failures = 0 if is_alive(*peer) else failures + 1
            self.health[peer] = (time.monotonic(), failures)
            if failures >= HEALTH_FAILURES:
                self._peer_gone(peer)

    def _peer_gone(self, peer: tuple[str, int]) -> None:
        self.routes.pop(peer, None)
        self.health.pop(peer, None)
        for room, pending in list(self.pending.items()):
            if (pending.host, pending.port) == peer:
                self._drop(room)
                self.emit("failed", room, f"the prefill server at {peer[0]}:{peer[1]} is gone "
                          "(its bootstrap server stopped answering) before the KV arrived", 502)

    def _drop(self, room: int) -> None:
        del self.pending[room]
        self.backend.forget(room)

    def _route(self, host: str, port: int) -> str:
        endpoint = self.routes.get((host, port))
        if endpoint is None:
            route = lookup_route(host, port, timeout=min(5.0, self.timeout))
            endpoint = self.routes[(host, port)] = str(route["endpoint"])
        return endpoint

    def _send(self, endpoint: str, msg: dict[str, Any]) -> None:
        sock = self.dealers.get(endpoint)
        if sock is None:
            sock = self.dealers[endpoint] = peer_socket(self.ctx, zmq.DEALER)
            sock.connect(endpoint)
            self.watch(sock)
        sock.send(self.codec.dumps(msg))

    def shutdown(self) -> None:
        for sock in self.dealers.values():
            sock.close(linger=0)


@dataclass
class _Incoming:
    req: Req
    slots: torch.Tensor  # the slots allocated for the transferred positions
    cancelled: bool = False


class DecodeSide(SchedulerExtension):
    """The decode scheduler's part (``--disaggregation-mode decode``): the bootstrap queue,
    the requests in transfer, and their arrival in the running batch."""

    name = "disaggregation-decode"
    mode = "decode"
    serves_fields = frozenset({"bootstrap"})

    @classmethod
    def enabled(cls, settings: ServerSettings) -> bool:
        return options_of(settings).mode == "decode"

    def __init__(self, scheduler: SchedulerView) -> None:
        super().__init__(scheduler)
        backend = transfer_backend(scheduler)
        opts = options_of(scheduler.settings)
        self.default_port = opts.bootstrap_port
        #: the prefill servers requests may name (--disaggregation-prefill-host)
        self.allowed_hosts = opts.prefill_hosts
        secret = opts.secret
        self.link = DecodeLink(scheduler.zmq, backend, opts.timeout, LinkCodec(secret))
        #: KV from prefill servers enters the prefix cache only when they are authenticated
        self.shares_peer_kv = secret is not None
        if not self.shares_peer_kv:
            logger.warning("KV from prefill servers serves its own request only, never the "
                           "prefix cache: give both servers --disaggregation-secret (or "
                           "SGL_DISAGGREGATION_SECRET) to authenticate them and share it")
        self.link.start()
        self.wake = self.link.wake
        self.queue: deque[Req] = deque()
        self.transferring: dict[int, _Incoming] = {}
        self.transfers = self.failures = self.bytes = 0
        self.seconds = 0.0
        self._failing = False  # failing a request whose transfer failed: nothing to tell

    def check(self, req: Req) -> str | None:
        if (error := request_error(req, self.mode)) is not None:
            return error
        host = req.bootstrap.host
        if not prefill_host_allowed(host, self.allowed_hosts):
            allowed = ", ".join(self.allowed_hosts) or "loopback addresses only"
            return (f"bootstrap_host {host[:100]!r} is not a prefill server this decode server "
                    f"takes KV from (--disaggregation-prefill-host: {allowed})")
        room = req.bootstrap.room
        if room in self.transferring or any(r.bootstrap and r.bootstrap.room == room
                                            for r in self.queue):
            return f"bootstrap_room {room} is already in use on this decode server"
        return None

    def take(self, req: Req) -> bool:
        """Every request waits here for its KV from the prefill server (one with nothing to
        generate ends at once: nothing to transfer)."""
        if req.sampling.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            self.scheduler.reply(req)
            return True
        req.next_input_logprob = len(req.input_ids)  # the prefill server reports those
        self.queue.append(req)
        return True

    @property
    def busy(self) -> bool:
        """Requests wait for memory that no transfer in flight will free: keep scheduling."""
        return bool(self.queue) and not self.transferring

    def before_step(self) -> list[Req]:
        """Handle the link's events (returning the requests whose KV arrived: they run from
        now), then start transfers for the queued requests that fit."""
        arrived = [req for event in self.link.events() if (req := self._on_event(event))]
        self._start_transfers()
        return arrived

    def _on_event(self, event: tuple[Any, ...]) -> Req | None:
        s = self.scheduler
        if event[0] == "link_failed":
            for room in list(self.transferring):
                incoming = self.transferring.pop(room)
                self._free(incoming)
                if not incoming.cancelled:
                    s.fail(incoming.req, "the KV transfer link stopped (see the server log)", 500)
                    s.reply(incoming.req)
            return None
        incoming = self.transferring.pop(event[1], None)
        if incoming is None:
            return None
        req = incoming.req
        if event[0] == "done" and not incoming.cancelled:
            try:
                self._arrive(req, event[2])
                self.transfers += 1
                self.bytes += int(event[2].get("bytes") or 0)
                self.seconds += float(event[2].get("seconds") or 0.0)
            except KVTransferError as exc:  # what the prefill server sent is not usable
                self._free(incoming)
                s.fail(req, str(exc), 502)
                s.reply(req)
                return None
            except Exception as exc:  # noqa: BLE001 (one request fails, the server goes on)
                logger.exception("taking over request %s failed", req.rid)
                self._free(incoming)
                s.fail(req, f"internal error while taking over the prefilled request: {exc}",
                       500)
                s.reply(req)
                return None
            return req
        self._free(incoming)
        if event[0] == "failed" and not incoming.cancelled:
            self.failures += 1
            self._failing = True
            try:
                s.fail(req, event[2], event[3])
            finally:
                self._failing = False
            s.reply(req)
        return None

    def _arrive(self, req: Req, msg: dict[str, Any]) -> None:
        s = self.scheduler
        req.kv_len = len(req.input_ids)
        token = msg.get("token")
        if not isinstance(token, int) or isinstance(token, bool) \
                or not 0 <= token < s.runner.vocab_size:
            raise KVTransferError(f"the prefill server sent first token {token!r}, not a token "
                                  f"id of this model's vocabulary ({s.runner.vocab_size})")
        self._check_finite(req)
        req.output_ids.append(token)
        req.first_token_time = time.time()
        logprobs = msg.get("logprobs") or {}
        if req.logprobs.return_logprob:
            req.output_token_logprobs.extend(_entry(e) for e in
                                             logprobs.get("output_token_logprobs", []))
            req.output_top_logprobs.extend(
                None if top is None else [_entry(e) for e in top]
                for top in logprobs.get("output_top_logprobs", []))
            req.output_token_ids_logprobs.extend(
                None if ids is None else [_entry(e) for e in ids]
                for ids in logprobs.get("output_token_ids_logprobs", []))
        if self.shares_peer_kv:
            s.cache_prompt(req)  # later requests with this prompt's prefix find it here
        else:
            req.private_kv = True
        s.run(req)
        s.take_token(req, token)  # the grammar, the finish check

    def _check_finite(self, req: Req) -> None:
        """The transferred rows hold no NaN or infinity: attention spreads one to every token
        after it, and through the prefix cache to every request that shares the prefix."""
        s = self.scheduler
        table = s.runner.req_to_token_pool.req_to_token
        slots = table[req.row, len(req.prefix):len(req.input_ids)].long()
        for buffer in self.link.backend.buffers.tensors:
            if buffer.is_floating_point() and \
                    not torch.isfinite(buffer.index_select(0, slots.to(buffer.device))).all():
                raise KVTransferError("the prefill server sent KV that is not finite (NaN or "
                                      "infinity); the request was not run")

    def _start_transfers(self) -> None:
        """Ask the prefill servers for the KV of the queued requests, in order, while KV
        memory and request rows allow."""
        while self.queue:
            req = self.queue[0]
            slots = self.scheduler.reserve(req, [i.req for i in self.transferring.values()])
            if slots is None:
                return
            self.queue.popleft()
            boot = req.bootstrap
            assert boot is not None
            self.transferring[boot.room] = _Incoming(req, slots)
            self.link.command("want", boot.room, boot.host, boot.port or self.default_port,
                              slots.tolist(), len(req.prefix))

    def _free(self, incoming: _Incoming) -> None:
        """Give back what a request that will not run holds: its transfer slots, its locked
        prefix, its row."""
        self.scheduler.discard(incoming.req, incoming.slots)

    def ended(self, req: Req, message: str) -> None:
        """``req`` failed here before it asked for its KV (refused, or its grammar failed):
        tell its prefill server, which would otherwise hold the KV until the timeout."""
        boot = req.bootstrap
        if boot is None or req.output_ids or boot.room in self.transferring or self._failing \
                or any(r.bootstrap == boot for r in self.queue if r is not req):
            return  # (another request of that room: refused as a duplicate, not abandoned)
        self.link.command("abandon", boot.room, boot.host, boot.port or self.default_port)

    def abort(self, rid: str) -> None:
        for req in list(self.queue):
            if req.rid == rid:
                self.queue.remove(req)
        for room, incoming in self.transferring.items():
            if incoming.req.rid == rid and not incoming.cancelled:
                incoming.cancelled = True
                self.link.command("cancel", room)

    def info(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode, "num_bootstrap_reqs": len(self.queue),
                "num_transfer_reqs": len(self.transferring), "kv_transfers": self.transfers,
                "kv_transfer_failures": self.failures, "kv_transfer_bytes": self.bytes,
                "kv_transfer_seconds": round(self.seconds, 6)}

    def close(self) -> None:
        self.link.close()


def _entry(e: Any) -> tuple[Any, ...]:
    return tuple(e) if isinstance(e, list) else e
