"""The fuzz suite (issue 17): schemathesis over the server's own ``/openapi.json``, and a
checked-in corpus of hostile bodies for every generation route (``hostile_bodies.json``, written
by ``make_hostile_bodies.py``). The assertion is the same for both: no 5xx, no connection the
server drops, and afterwards the server answers as before and holds no memory.

Its own server (the fuzzer opens sessions, aborts everything, flushes the cache), with a short
context so that no generated request runs long. Hypothesis is derandomized: CI runs the same
examples every time, and a failure reproduces.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from sgl_testing import ServerProcess

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).with_name("hostile_bodies.json")
#: the fuzz server's context: every generation ends within this many tokens
CONTEXT = 160
PROBE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8,
                                                                 "temperature": 0}}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    proc = ServerProcess("--context-length", str(CONTEXT), "--max-total-tokens", "4096",
                         log_path=log)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def probe_before(fuzz_server: ServerProcess) -> str:
    """A greedy answer before any fuzzing, to compare with afterwards."""
    return httpx.post(f"{fuzz_server.base_url}/generate", json=PROBE, timeout=60).json()["text"]


def _pin_model(node: Any, names: list[str]) -> None:
    """Every ``model`` field takes the served names only: a random model name is a 404 before
    anything else is looked at, which would leave the rest of the body untested."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and "model" in props:
            props["model"] = {"enum": names}
        for value in node.values():
            _pin_model(value, names)
    elif isinstance(node, list):
        for value in node:
            _pin_model(value, names)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess, probe_before: str) -> Any:
    raw = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=60).json()
    served = httpx.get(f"{fuzz_server.base_url}/v1/models", timeout=60).json()["data"][0]["id"]
    _pin_model(raw, [served, "default"])
    return schemathesis.openapi.from_dict(raw)


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    """One keep-alive connection for all the cases, as a client library holds it."""
    with requests.Session() as s:
        yield s


#: examples per operation
EXAMPLES = 25


def test_no_generated_request_gets_a_server_error(api_schema: Any, fuzz_server: ServerProcess,
                                                  session: requests.Session) -> None:
    """Every operation of the schema, ``EXAMPLES`` cases each (schemathesis' pytest fixture
    loader does not run under this pytest, so hypothesis drives each operation here)."""
    failures: list[tuple[str, str, str]] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) > 20 and all(op is not None for op in operations)
    for op in operations:
        @given(op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            response = case.call(base_url=fuzz_server.base_url, session=session, timeout=120)
            if response.status_code >= 500 or \
                    response.headers.get("connection", "").lower() == "close":
                failures.append((f"{op.method.upper()} {op.path}", case.as_curl_command(),
                                 f"{response.status_code} {response.text[:300]}"))

        run()
    assert not failures, failures[:10]


def _expand(value: Any) -> Any:
    """The corpus' shorthand: ``{"$repeat": [v, n]}`` is ``v * n``."""
    if isinstance(value, dict):
        if set(value) == {"$repeat"}:
            item, count = value["$repeat"]
            return item * count
        return {k: _expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


def _content(entry: dict[str, Any]) -> bytes:
    if "raw_base64" in entry:
        return base64.b64decode(entry["raw_base64"])
    if "raw_parts" in entry:
        return "".join(_expand(part) for part in entry["raw_parts"]).encode()
    if "raw" in entry:
        return entry["raw"].encode("utf-8", "surrogatepass")
    return json.dumps(_expand(entry["json"])).encode()


def test_the_hostile_corpus_gets_no_server_error(fuzz_server: ServerProcess) -> None:
    corpus = json.loads(CORPUS.read_text())
    routes = {entry["route"] for entry in corpus}
    assert len(corpus) > 1000 and len(routes) == 6
    failures = []
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=fuzz_server.base_url, timeout=120) as client:
        for entry in corpus:
            try:
                response = client.post(entry["route"], content=_content(entry),
                                       headers={"content-type": "application/json"})
            except httpx.TransportError as exc:  # a dropped or reset connection
                failures.append((entry["route"], entry["why"], f"{type(exc).__name__}: {exc}"))
                continue
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500 or response.headers.get("connection") == "close":
                failures.append((entry["route"], entry["why"], response.status_code,
                                 response.text[:200]))
    assert not failures, failures[:20]
    assert statuses.get(400, 0) > len(corpus) // 2 and statuses.get(200, 0) > 0, statuses


def test_the_server_is_unharmed_afterwards(fuzz_server: ServerProcess, probe_before: str) -> None:
    """Runs after the fuzzing: the same greedy answer as before, nothing running or waiting,
    and every KV slot free once the cache is flushed."""
    base = fuzz_server.base_url
    after = httpx.post(f"{base}/generate", json=PROBE, timeout=60)
    assert after.status_code == 200 and after.json()["text"] == probe_before
    assert httpx.post(f"{base}/flush_cache", timeout=60).status_code == 200
    load = httpx.get(f"{base}/get_server_info", timeout=60).json()["internal_states"][0]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert load["kv_used_tokens"] == 0 and load["kv_free_tokens"] == load["kv_total_tokens"]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
