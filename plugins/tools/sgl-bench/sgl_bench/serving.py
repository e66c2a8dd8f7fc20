"""``sgl bench serving``: stream requests to a running server and time every chunk.

Backends (``--backend``):

* ``sgl``: SGLang's native ``POST /generate`` with ``"stream": true`` (sgl and SGLang). Each
  event carries the output so far; ``meta_info.completion_tokens`` says how many tokens it holds.
* ``openai-completions``: ``POST /v1/completions`` (sgl, SGLang, vLLM, llama.cpp's
  llama-server), ``stream_options.include_usage`` for the token counts.
* ``openai-chat``: ``POST /v1/chat/completions``, the prompt as one user message (after a
  system message for ``generated-shared-prefix``).

Greedy (``temperature 0``) with ``ignore_eos`` unless ``--disable-ignore-eos``, so each request
generates its requested length. Token counts are the server's when it reports them (native
``meta_info``, OpenAI ``usage``), else the prompt's own count and the number of output chunks.

The requests go out on aiohttp, as in SGLang's ``bench_serving``: the client shares the
machine with the server, and what it spends per streamed chunk is taken from the server;
aiohttp spends less CPU per chunk than httpx (docs/benchmarks.md, "The benchmark client's
CPU").
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sgl_bench.datasets import BenchError, BenchRequest
from sgl_bench.metrics import RequestResult

if TYPE_CHECKING:
    import aiohttp

__all__ = ["BACKENDS", "ServingRun", "check_server", "flush_cache", "resolve_model",
           "run_serving"]

BACKENDS = ("sgl", "openai-chat", "openai-completions")


@dataclass
class ServingRun:
    """The settings of one run that the request coroutine needs."""

    base_url: str
    backend: str
    model: str
    ignore_eos: bool = True
    api_key: str | None = None
    timeout: float | None = None
    extra_body: dict[str, Any] | None = None  # merged into every request (--extra-request-body)
    stream: bool = True  # False: one response per request (--disable-stream)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _payload(run: ServingRun, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    """The route and body of one streamed request, ``run.extra_body`` merged in."""
    route, body = _route_and_body(run, req)
    if not run.stream:
        body["stream"] = False
        body.pop("stream_options", None)
    return route, {**body, **(run.extra_body or {})}


def _route_and_body(run: ServingRun, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    if run.backend == "sgl":
        key = "text" if isinstance(req.prompt, str) else "input_ids"
        prompt = req.text if isinstance(req.prompt, str) else req.prompt
        return "/generate", {
            key: prompt, "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0,
                                "ignore_eos": run.ignore_eos}}
    if not isinstance(req.prompt, str):
        raise BenchError(f"backend {run.backend!r} needs text prompts")
    body: dict[str, Any] = {"model": run.model, "max_tokens": req.output_len, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if run.ignore_eos:
        body["ignore_eos"] = True
    if run.backend == "openai-completions":
        body["prompt"] = req.text
        return "/v1/completions", body
    messages = [{"role": "system", "content": req.system}] if req.system else []
    body["messages"] = messages + [{"role": "user", "content": req.prompt}]
    return "/v1/chat/completions", body


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The lines of a streamed body as they arrive, of any length (aiohttp's own line reader
    stops at 64 KiB)."""
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending.rstrip(b"\r")


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The JSON payloads of a server-sent-event stream, up to ``data: [DONE]``."""
    async for line in _lines(response):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BenchError(f"the server sent an event that is not JSON: {data[:200]!r}") from None


def _error_text(event: Any) -> str | None:
    if isinstance(event, dict) and event.get("error"):
        err = event["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return None


async def _whole(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """A response that is not streamed, as the one event it is."""
    try:
        yield json.loads(await response.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BenchError("the server's response is not JSON") from None


async def send_request(session: aiohttp.ClientSession, run: ServingRun,
                       req: BenchRequest) -> RequestResult:
    """Send one request, read its stream and time each chunk that adds output (without
    streaming: the one response, whose arrival is both the first token and the end)."""
    import aiohttp

    route, body = _payload(run, req)
    result = RequestResult(success=False, start=time.perf_counter(), end=0.0,
                           prompt_len=req.prompt_len, output_len=0)
    chunks = 0
    reported_out: int | None = None
    try:
        async with session.post(run.base_url + route, json=body, headers=run.headers) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:500]}"
                return result
            async for event in (_events(response) if run.stream else _whole(response)):
                now = time.perf_counter()
                if (err := _error_text(event)) is not None:
                    result.error = err
                    return result
                new, prompt_tokens, out_tokens = _progress(run.backend, event, reported_out)
                if prompt_tokens is not None:
                    result.prompt_len = prompt_tokens
                if out_tokens is not None:
                    reported_out = out_tokens
                if new:
                    chunks += 1
                    result.chunk_times.append(now)
        result.end = time.perf_counter()
        result.output_len = reported_out if reported_out is not None else chunks
        result.success = bool(result.chunk_times) or req.output_len == 0
        if not result.success:
            result.error = "the stream ended without output"
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except BenchError as exc:
        result.error = str(exc)
    finally:
        if not result.end:
            result.end = time.perf_counter()
    return result


def _progress(backend: str, event: Any, seen: int | None) -> tuple[bool, int | None, int | None]:
    """(whether this event adds output, prompt tokens if reported, output tokens so far if
    reported)."""
    if not isinstance(event, dict):
        return False, None, None
    if backend == "sgl":
        meta = event.get("meta_info") or {}
        total = meta.get("completion_tokens")
        if isinstance(total, int):
            return total > (seen or 0), meta.get("prompt_tokens"), total
        return bool(event.get("text")), meta.get("prompt_tokens"), None
    usage = event.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens")
    out_tokens = usage.get("completion_tokens")
    new = False
    for choice in event.get("choices") or ():
        if backend == "openai-completions":
            new = new or bool(choice.get("text"))
        else:
            delta = choice.get("delta") or choice.get("message") or {}
            new = new or bool(delta.get("content") or delta.get("reasoning_content"))
    return new, prompt_tokens, out_tokens


# --- the server ---------------------------------------------------------------------------------

def server_accept_length(base_url: str, api_key: str | None = None) -> float | None:
    """The server's mean speculative acceptance length (``avg_spec_accept_length`` in the
    ``internal_states`` of ``/get_server_info``, where SGLang's bench_serving reads it); None
    when it has none (no speculation, or a server without that route)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = httpx.get(base_url + "/get_server_info", headers=headers, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states") or [{}]
    value = (states[0] if isinstance(states[0], dict) else {}).get(
        "avg_spec_accept_length", info.get("avg_spec_accept_length"))
    return float(value) if isinstance(value, (int, float)) else None


def check_server(base_url: str, api_key: str | None = None) -> None:
    """Fail with a clear message when nothing answers at ``base_url``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        httpx.get(base_url + "/health", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach the server at {base_url}: {type(exc).__name__}: {exc} "
                         f"(is it running? start one with `sgl serve`, or pass --base-url)"
                         ) from None


def resolve_model(base_url: str, api_key: str | None = None) -> str | None:
    """The first id of ``GET /v1/models``, or None when the server has no such route."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url + "/v1/models", headers=headers, timeout=10)
        data = r.json().get("data") if r.status_code == 200 else None
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def server_tokenizer_path(base_url: str, api_key: str | None = None) -> str | None:
    """The tokenizer path an sgl or SGLang server reports (``/get_model_info``), if any."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url + "/get_model_info", headers=headers, timeout=10)
        info = r.json() if r.status_code == 200 else {}
        path = info.get("tokenizer_path") or info.get("model_path")
        return path if isinstance(path, str) else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def flush_cache(base_url: str, api_key: str | None = None) -> str:
    """``POST /flush_cache``; returns what happened, in words (servers without it are fine)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(base_url + "/flush_cache", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        return f"flush_cache failed: {exc}"
    if r.status_code in (404, 405):
        return "the server has no /flush_cache; not flushed"
    if r.status_code != 200:
        return f"flush_cache answered {r.status_code}: {r.text.strip()[:200]}"
    return "cache flushed"


# --- the run ------------------------------------------------------------------------------------

def arrival_delays(n: int, request_rate: float, seed: int) -> list[float]:
    """Gaps before each request: 0 for ``inf``, else exponential with mean ``1/rate`` (Poisson
    arrivals), seeded."""
    if request_rate == float("inf"):
        return [0.0] * n
    if request_rate <= 0:
        raise BenchError(f"--request-rate must be positive (or inf), got {request_rate}")
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(n)]


async def _run(run: ServingRun, requests: list[BenchRequest], *, request_rate: float,
               max_concurrency: int | None, seed: int,
               on_done: Callable[[RequestResult], None]) -> tuple[list[RequestResult], float]:
    import aiohttp

    limit = max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    # run.timeout bounds each whole request; None: no limit (aiohttp's default is 5 minutes)
    timeout = aiohttp.ClientTimeout(total=run.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit + 4),
                                     timeout=timeout, trust_env=True) as session:

        async def one(req: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await send_request(session, run, req)
            on_done(result)
            return result

        tasks = []
        start = time.perf_counter()
        for req, delay in zip(requests, arrival_delays(len(requests), request_rate, seed)):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
    end = max((r.end for r in results), default=start)
    return list(results), end - start


def run_serving(run: ServingRun, requests: list[BenchRequest], *,
                request_rate: float = float("inf"), max_concurrency: int | None = None,
                seed: int = 0,
                on_done: Callable[[RequestResult], None] = lambda r: None,
                ) -> tuple[list[RequestResult], float]:
    """Send ``requests`` (arrivals by ``request_rate``, at most ``max_concurrency`` in flight);
    returns every result and the duration in seconds."""
    return asyncio.run(_run(run, requests, request_rate=request_rate,
                            max_concurrency=max_concurrency, seed=seed, on_done=on_done))
