"""ASGI middleware the core wraps around every route, whatever frontend plugin serves it.

* :class:`ApiKeyMiddleware` -- ``--api-key``: every route except exactly ``/health`` and
  ``/metrics`` needs ``Authorization: Bearer <key>``; otherwise 401. (SGLang exempts every path
  starting with ``/health``; ``/health_generate`` runs a generation, so here it needs the key.)
* :class:`BodySizeLimitMiddleware` -- ``--max-request-body-size``: a larger body gets 413, by
  its ``Content-Length`` before anything is read, or while it streams in when chunked.
* :class:`CancelOnDisconnectMiddleware` -- a client that goes away before its response is
  complete cancels the route's task; the TokenizerManager then aborts the request in the
  scheduler, which frees its KV memory. This covers streaming and non-streaming routes alike.

They are plain ASGI callables rather than Starlette's ``BaseHTTPMiddleware``, which would buffer
streaming responses and hide the client's disconnect from the route.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ApiKeyMiddleware", "BodySizeLimitMiddleware", "CancelOnDisconnectMiddleware"]

logger = logging.getLogger("sgl.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the paths served without the API key, exactly: load balancers and Prometheus probe them,
#: and they cost nothing (``/health_generate``, which runs the model, is not one of them)
OPEN_PATHS = frozenset({"/health", "/metrics"})


async def send_json(send: Send, status: int, body: dict[str, Any],
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer a request with a JSON body, from inside a middleware."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """Refuse requests without ``Authorization: Bearer <api_key>`` or ``x-api-key: <api_key>``
    (the header Anthropic's clients send) with status 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" \
                or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
        # the scheme is case-insensitive (RFC 9110): "bearer KEY" is as good as "Bearer KEY"
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(credentials, self.expected)
        x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected)
        if not (bearer or x_api_key):
            await send_json(send, 401, {"error": {
                "message": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "type": "authentication_error", "code": 401}},
                headers=[(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse request bodies larger than ``limit`` bytes (status 413)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _error(self) -> dict[str, Any]:
        return {"error": {"message": f"the request body is larger than {self.limit} bytes "
                          "(--max-request-body-size)", "type": "invalid_request_error",
                          "code": 413}}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await send_json(send, 413, self._error(), headers=[(b"connection", b"close")])
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_json(send, 413, self._error(), headers=[(b"connection", b"close")])


class _BodyTooLarge(Exception):
    """Raised out of ``receive`` when a chunked body passes the limit."""


class CancelOnDisconnectMiddleware:
    """Cancel a route when its client disconnects before the response is complete.

    The route's body is read ahead by a pump task and handed over through a queue, so the pump
    sees the ``http.disconnect`` message as soon as the server does, whatever the route is
    awaiting. Cancelling the route raises ``CancelledError`` in it; the TokenizerManager's calls
    answer that by sending an ``AbortRequest`` to the scheduler.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # bounded, so a route that does not read its body does not make the pump buffer it all
        queue: asyncio.Queue[Message] = asyncio.Queue(maxsize=16)
        disconnected = False
        response_complete = False

        async def pump() -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                await queue.put(message)
                if disconnected:
                    return

        async def queued_receive() -> Message:
            if disconnected and queue.empty():
                return {"type": "http.disconnect"}
            return await queue.get()

        async def tracking_send(message: Message) -> None:
            nonlocal response_complete
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_complete = True

        route = asyncio.ensure_future(self.app(scope, queued_receive, tracking_send))
        pumping = asyncio.ensure_future(pump())
        try:
            await asyncio.wait({route, pumping}, return_when=asyncio.FIRST_COMPLETED)
            failed = pumping.exception() if pumping.done() else None
            if failed is not None or (not route.done() and not response_complete):
                if failed is None:
                    logger.info("client of %s %s disconnected; cancelling its request",
                                scope.get("method"), scope.get("path"))
                route.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await route
                if failed is not None:  # e.g. the body grew past the size limit
                    raise failed
                return
            await route  # finished, or finishing after its response (background tasks)
        except asyncio.CancelledError:
            if route.done() and not route.cancelled():
                raise
            # uvicorn cancels what still runs when --graceful-shutdown-timeout ends; the
            # request is aborted below, and the cancellation ends here rather than as a
            # traceback in uvicorn's log
            logger.warning("%s %s aborted: the server is shutting down", scope.get("method"),
                           scope.get("path"))
        finally:
            for task in (pumping, route):
                if not task.done():  # our own task was cancelled (shutdown)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
