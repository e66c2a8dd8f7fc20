"""sgl bench's streaming client (aiohttp) against server behaviour that sgl's own server does
not produce on demand: an event line past aiohttp's 64 KiB line limit, split over many writes
with CRLF line ends; an error status; a stream that stops sending; an event that is not JSON.

The server here is a real aiohttp web server on a loopback port in a thread of the test
process (a stand-in for a misbehaving server: the faults cannot be caused in sgl's); the
client is sgl bench's own ``run_serving``. The normal path against sgl's real server is
tests/plugins/tools/test_bench_cli.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from sgl_bench.datasets import BenchRequest
from sgl_bench.serving import ServingRun, run_serving

LONG_TEXT = "x" * 100_000  # one event line of about 100 KiB


def _event(text: str, completion_tokens: int | None = None) -> bytes:
    event: dict = {"choices": [{"index": 0, "text": text}]}
    if completion_tokens is not None:
        event["choices"] = []
        event["usage"] = {"prompt_tokens": 3, "completion_tokens": completion_tokens}
    return b"data: " + json.dumps(event).encode() + b"\r\n\r\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body["prompt"]
    if mode == "error":
        return web.Response(status=400, text='{"error": {"message": "bad max_tokens"}}')
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if mode == "long":
        data = (_event("a") + _event(LONG_TEXT) + _event("b") + _event("", 3)
                + b"data: [DONE]\r\n\r\n")
        for i in range(0, len(data), 4096):  # many small writes: lines split across reads
            await response.write(data[i:i + 4096])
    elif mode == "stall":
        await response.write(_event("a"))
        await asyncio.sleep(30)
    elif mode == "not-json":
        await response.write(b"data: {not json\n\n")
    await response.write_eof()
    return response


@pytest.fixture(scope="module")
def odd_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app, shutdown_timeout=1.0)  # the stalled handler is cancelled
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
    asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


async def _cancel_the_rest() -> None:
    """Cancel what is left of the handlers (the stalled one) before the loop goes."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


def _run(base_url: str, prompt: str, timeout: float | None = None):
    run = ServingRun(base_url=base_url, backend="openai-completions", model="m", timeout=timeout)
    results, duration = run_serving(run, [BenchRequest(prompt=prompt, prompt_len=3, output_len=3)])
    assert duration >= 0
    return results[0]


def test_an_event_longer_than_64_kib_split_over_reads_is_parsed(odd_server: str) -> None:
    result = _run(odd_server, "long")
    assert result.success, result.error
    assert len(result.chunk_times) == 3  # "a", the long one, "b"; the usage event adds none
    assert result.output_len == 3 and result.prompt_len == 3  # the server's usage counts


def test_an_error_status_is_reported_with_its_body(odd_server: str) -> None:
    result = _run(odd_server, "error")
    assert not result.success
    assert result.error.startswith("HTTP 400:") and "bad max_tokens" in result.error


def test_a_stalled_stream_ends_at_the_timeout_as_an_error(odd_server: str) -> None:
    result = _run(odd_server, "stall", timeout=1.0)
    assert not result.success
    assert "Timeout" in result.error
    assert result.end - result.start < 10  # not the server's 30 s


def test_an_event_that_is_not_json_is_an_error(odd_server: str) -> None:
    result = _run(odd_server, "not-json")
    assert not result.success
    assert "not JSON" in result.error
