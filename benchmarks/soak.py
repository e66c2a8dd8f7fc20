"""Soak: mixed traffic with faults, then check that the server is back to idle.

    .venv/bin/python benchmarks/soak.py [--requests 1000] [--rounds 1] [--concurrency 32]
        [--seed 0] [--url http://127.0.0.1:30000 | --server-args "--max-total-tokens 4096"]

Sends ``--requests`` requests at ``--concurrency``, drawn at random from every frontend: OpenAI
chat and completions (streamed or not, ``n=2``, logprobs, JSON schema), SGLang's ``/generate``
(streamed, with an explicit ``/abort_request``, in a session of two turns), Anthropic messages
and Ollama chat. A share of them is cut on purpose: a stream closed after a random number of
chunks, a request whose client gives up after a random delay, a ``/generate`` aborted by id.

After each round it waits for the server to drain and compares with the idle state measured after a
warm-up: requests running, waiting and tracked by the server process, KV slots in use (after a
cache flush), request-table rows, open sessions, and the resident memory of the server's
processes. A request is *lost* when it neither answered nor failed within ``--timeout``. Exit
status 1 if anything was lost, leaked or answered a 5xx. Without ``--url`` it starts its own
``sgl serve`` on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

#: answer wanted from a JSON-schema request
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population":
          {"type": "integer"}}, "required": ["city", "population"]}
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
             "Explain gravity in one sentence.", "List the planets.", "Who wrote Hamlet?",
             "Describe a cat.", "What is 12 times 12?"]
PROBE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8,
                                                                 "temperature": 0}}


class Soak:
    def __init__(self, client: httpx.AsyncClient, rng: random.Random, timeout: float) -> None:
        self.client, self.rng, self.timeout = client, rng, timeout
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.rng.choice(QUESTIONS)}]

    def length(self) -> int:
        return self.rng.choice([1, 4, 16, 48, 96])

    async def one(self) -> None:
        kinds = [self.chat, self.chat_stream, self.completions, self.generate_abort,
                 self.generate_stream, self.json_schema, self.session, self.anthropic_stream,
                 self.ollama_stream, self.give_up]
        kind = self.rng.choice(kinds)
        self.by_kind[kind.__name__] += 1
        try:
            outcome = await asyncio.wait_for(kind(), self.timeout)
        except asyncio.TimeoutError:
            outcome = "lost"
            self.errors.append(f"{kind.__name__}: no answer within {self.timeout} s")
        except httpx.HTTPError as exc:
            outcome = "error"
            self.errors.append(f"{kind.__name__}: {type(exc).__name__}: {exc}")
        self.outcomes[outcome] += 1

    def judge(self, kind: str, response: httpx.Response) -> str:
        if response.status_code == 200:
            return "ok"
        self.errors.append(f"{kind}: {response.status_code} {response.text[:200]}")
        return "server error" if response.status_code >= 500 else "refused"

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.client.post(path, json=body)

    async def stream(self, kind: str, path: str, body: dict[str, Any]) -> str:
        """Read a stream; with probability 0.3 close it after a random number of chunks."""
        cut_after = self.rng.randint(1, 8) if self.rng.random() < 0.3 else None
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return self.judge(kind, response)
            chunks = 0
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                if '"error"' in line and not line.startswith("event:"):
                    self.errors.append(f"{kind}: error in stream: {line[:200]}")
                    return "server error"
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    return "cut"  # leaving the block closes the connection mid-stream
        return "ok"

    async def chat(self) -> str:
        response = await self.post("/v1/chat/completions", {
            "model": "default", "messages": self.messages(), "max_tokens": self.length(),
            "temperature": self.rng.choice([0, 0.7])})
        return self.judge("chat", response)

    async def chat_stream(self) -> str:
        return await self.stream("chat_stream", "/v1/chat/completions", {
            "model": "default", "messages": self.messages(), "max_tokens": self.length(),
            "stream": True, "stream_options": {"include_usage": True}})

    async def completions(self) -> str:
        response = await self.post("/v1/completions", {
            "model": "default", "prompt": self.rng.choice(QUESTIONS), "n": 2, "logprobs": 2,
            "max_tokens": self.length(), "temperature": 0.8})
        return self.judge("completions", response)

    async def generate_abort(self) -> str:
        """``/generate`` by rid; with probability 0.3 aborted by ``/abort_request`` meanwhile."""
        rid = f"soak-{uuid.uuid4().hex}"
        body = {"text": self.rng.choice(QUESTIONS), "rid": rid, "return_logprob": True,
                "sampling_params": {"max_new_tokens": self.length(), "ignore_eos": True}}
        task = asyncio.ensure_future(self.post("/generate", body))
        if self.rng.random() < 0.3:
            await asyncio.sleep(self.rng.uniform(0, 0.5))
            await self.post("/abort_request", {"rid": rid})
            response = await task
            if response.status_code == 200:  # what was generated, ended by the abort (or done)
                return "aborted"
            return self.judge("generate_abort", response)
        return self.judge("generate_abort", await task)

    async def generate_stream(self) -> str:
        return await self.stream("generate_stream", "/generate", {
            "text": self.rng.choice(QUESTIONS), "stream": True,
            "sampling_params": {"max_new_tokens": self.length()}})

    async def json_schema(self) -> str:
        response = await self.post("/v1/chat/completions", {
            "model": "default", "messages": self.messages(), "max_tokens": 64,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "city", "schema": SCHEMA}}})
        outcome = self.judge("json_schema", response)
        if outcome == "ok" and response.json()["choices"][0]["finish_reason"] == "stop":
            json.loads(response.json()["choices"][0]["message"]["content"])  # valid JSON
        return outcome

    async def session(self) -> str:
        """Two turns of one session, then close it."""
        opened = await self.post("/open_session", {})
        if opened.status_code != 200:
            return self.judge("session", opened)
        sid = opened.json()
        try:
            text = self.rng.choice(QUESTIONS)
            for _ in range(2):
                response = await self.post("/generate", {
                    "text": text, "session_params": {"id": sid},
                    "sampling_params": {"max_new_tokens": self.length(), "temperature": 0}})
                if response.status_code != 200:
                    return self.judge("session", response)
                text += response.json()["text"] + " Go on."
        finally:
            await self.post("/close_session", {"session_id": sid})
        return "ok"

    async def anthropic_stream(self) -> str:
        return await self.stream("anthropic_stream", "/v1/messages", {
            "model": "default", "max_tokens": self.length(), "messages": self.messages(),
            "stream": True})

    async def ollama_stream(self) -> str:
        return await self.stream("ollama_stream", "/api/chat", {
            "model": "default", "messages": self.messages(), "stream": True,
            "options": {"num_predict": self.length()}})

    async def give_up(self) -> str:
        """A client that stops waiting after a random delay (its connection closes)."""
        try:
            response = await asyncio.wait_for(self.post("/v1/chat/completions", {
                "model": "default", "messages": self.messages(), "max_tokens": 96,
                "ignore_eos": True}), self.rng.uniform(0.05, 1.0))
        except asyncio.TimeoutError:
            return "cut"
        return self.judge("give_up", response)


def _rss_mib(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of ``pid`` ("server") and of each process below it (by the start
    of its command line: the scheduler is a multiprocessing child)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
    out: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        rss = next((int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("VmRSS:")), 0)
        if p == pid:
            name = "server"
        elif "resource_tracker" in cmdline:
            name = "resource tracker"
        else:
            name = "scheduler" if "multiprocessing" in cmdline else cmdline[:40]
        out[name] = round(out.get(name, 0) + rss / 1024, 1)
    out["total"] = round(sum(out.values()), 1)
    return out


async def state(client: httpx.AsyncClient) -> dict[str, Any]:
    info = (await client.get("/get_server_info")).json()
    return info["internal_states"][0]


async def idle_state(client: httpx.AsyncClient, pid: int | None,
                     wait: float = 60.0) -> tuple[dict[str, Any], float]:
    """Wait until nothing runs, flush the cache, return the load and the seconds waited."""
    start = time.monotonic()
    while True:
        load = await state(client)
        busy = load["num_running_reqs"] or load["num_waiting_reqs"] or load["num_tracked_requests"]
        if not busy or time.monotonic() - start > wait:
            break
        await asyncio.sleep(0.2)
    waited = time.monotonic() - start
    await client.post("/flush_cache")
    load = await state(client)
    if pid is not None:
        load["rss_mib"] = _rss_mib(pid)
    return load, waited


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> int:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        probe = (await client.post("/generate", json=PROBE)).json()["text"]
        warm = Soak(client, random.Random(args.seed + 1), args.timeout)
        await asyncio.gather(*(warm.one() for _ in range(args.warmup)))
        before, _ = await idle_state(client, pid)
        rounds = []
        for number in range(1, args.rounds + 1):
            run = Soak(client, random.Random(args.seed + 1000 * number), args.timeout)
            elapsed = await _round(run, args, number)
            after, drain = await idle_state(client, pid)
            rounds.append((run, elapsed, after, drain))
        probe_after = (await client.post("/generate", json=PROBE)).json()["text"]

    bad = probe_after != probe
    reports = []
    for run, elapsed, after, drain in rounds:
        leaks = {
            "running or waiting": after["num_running_reqs"] + after["num_waiting_reqs"],
            "tracked by the server": after["num_tracked_requests"],
            "KV slots in use": after["kv_used_tokens"],
            "request rows": before["req_rows_free"] - after["req_rows_free"],
            "open sessions": after["num_sessions"] - before["num_sessions"],
        }
        reports.append({"seconds": round(elapsed, 1), "drain_seconds": round(drain, 2),
                        "outcomes": dict(run.outcomes), "kinds": dict(run.by_kind),
                        "leaks": leaks, "rss_mib": after.get("rss_mib"),
                        "num_retractions": after.get("num_retractions"),
                        "errors": run.errors[:20]})
        bad = bad or bool(run.outcomes["lost"] + run.outcomes["server error"]
                          + run.outcomes["error"] + sum(leaks.values()))
    report = {"requests_per_round": args.requests, "concurrency": args.concurrency,
              "seed": args.seed, "rss_mib_idle": before.get("rss_mib"),
              "probe_unchanged": probe_after == probe, "rounds": reports}
    print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if bad else 0


async def _round(run: Soak, args: argparse.Namespace, number: int) -> float:
    """Send one round of requests at the concurrency; returns its seconds."""
    remaining = args.requests
    done = 0
    started = time.monotonic()

    async def worker() -> None:
        nonlocal remaining, done
        while remaining > 0:
            remaining -= 1
            await run.one()
            done += 1
            if done % max(1, args.requests // 10) == 0:
                print(f"  round {number}: {done}/{args.requests} requests, "
                      f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of --requests, the idle "
                        "state measured after each (memory that keeps growing is a leak)")
    parser.add_argument("--warmup", type=int, default=40, help="requests before the idle state "
                        "is measured (allocators and caches settle)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds after which a request counts as lost")
    parser.add_argument("--url", help="an sgl server to soak (default: start one)")
    parser.add_argument("--server-args", default="--max-total-tokens 4096",
                        help="arguments of the sgl serve this script starts")
    parser.add_argument("--output", help="write the report as JSON here")
    args = parser.parse_args()
    if args.url:
        sys.exit(asyncio.run(soak(args, args.url, None)))
    from sgl_testing import ServerProcess

    server = ServerProcess(*shlex.split(args.server_args))
    try:
        sys.exit(asyncio.run(soak(args, server.base_url, server.proc.pid)))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
