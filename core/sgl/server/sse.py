"""Server-sent events for streaming routes: ``data: <json>\\n\\n`` per chunk, as SGLang and
OpenAI stream.

:class:`EventStreamResponse` closes its iterator however the response ends (finished, failed or
cancelled because the client went away), so a TokenizerManager stream inside it aborts its
request at once instead of when the garbage collector gets to it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

__all__ = ["EventStreamResponse", "dumps", "sse_event"]


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(obj: Any) -> bytes:
    """Strict JSON: non-finite floats (a logprob of ``-inf``) become ``null``, as orjson
    writes them in SGLang."""
    try:
        return json.dumps(obj, allow_nan=False, ensure_ascii=False).encode()
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, ensure_ascii=False).encode()


def sse_event(obj: Any) -> bytes:
    """One event: ``data: <json>`` and a blank line (``[DONE]`` is passed as the string)."""
    data = obj.encode() if isinstance(obj, str) else dumps(obj)
    return b"data: " + data + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its async iterator."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, **kwargs: Any) -> None:
        kwargs.setdefault("headers", {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        super().__init__(content, **kwargs)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
