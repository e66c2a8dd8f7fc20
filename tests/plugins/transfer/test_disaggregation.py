"""Prefill/decode disaggregation end to end: real `sgl serve --disaggregation-mode prefill` and
`decode` servers of the bundled SmolLM2, SGLang's own router in PD mode in front (`sgl router
--pd-disaggregation`), the KV moved by the tcp and the mooncake backends. Greedy outputs equal
one plain `sgl serve` (the session's float32 server) for /generate with logprobs, chat,
streaming and a JSON schema; the two servers use different page sizes (1 and 16); a 2,000-token
prompt runs in several chunks; a prefix cached on the decode server is not transferred again.

Failures, on tiny random-weight models with a short --disaggregation-timeout: a request only
one side receives (each side's bootstrap timeout), an unreachable bootstrap server, a decode-side
abort while waiting for KV, and a prefill server killed while the decode server waits for its
KV. Each ends with a clear error within the timeout, and both KV pools return to idle."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sgl_testing import ServerProcess, free_port, run_cli

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from test_router_command import sgl_router  # noqa: E402
from test_tensor_parallel import save_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
#: what the session's reference server runs with (tests/conftest.py), so outputs compare
REFERENCE_ARGS = ["--dtype", "float32", "--max-total-tokens", "16384"]
TIMEOUT_S = 4.0  # --disaggregation-timeout of the failure tests' servers
SECRET = "a secret of the pd fixture's two servers"


@dataclass
class PD:
    prefill: ServerProcess
    decode: ServerProcess
    bootstrap_port: int
    router: str = ""
    backend: str = "tcp"
    other_decode: ServerProcess | None = None  # one whose KV layout differs


def start_pd(args: list[str], prefill_args: list[str], decode_args: list[str],
             logs: Path, other_decode_args: list[str] | None = None,
             env: dict[str, str] | None = None) -> PD:
    """A prefill and a decode server (and another decode server) started side by side."""
    bootstrap = free_port()
    with ThreadPoolExecutor(3) as pool:
        prefill = pool.submit(ServerProcess, *args, "--disaggregation-mode", "prefill",
                              "--disaggregation-bootstrap-port", str(bootstrap), *prefill_args,
                              log_path=logs / "prefill.log", env=env)
        decode = pool.submit(ServerProcess, *args, "--disaggregation-mode", "decode",
                             *decode_args, log_path=logs / "decode.log", env=env)
        other = None if other_decode_args is None else pool.submit(
            ServerProcess, *args, "--disaggregation-mode", "decode", *other_decode_args,
            log_path=logs / "other-decode.log")
        return PD(prefill.result(), decode.result(), bootstrap,
                  other_decode=other.result() if other else None)


def state(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["internal_states"][0]


def assert_idle(*servers: ServerProcess, within: float = 10.0) -> None:
    """Nothing waits, runs or transfers, and after a cache flush the KV pool is all free."""
    for server in servers:
        deadline = time.monotonic() + within
        while True:
            s = state(server)
            busy = (s["num_running_reqs"], s["num_waiting_reqs"], s["num_transfer_reqs"],
                    s.get("num_bootstrap_reqs", 0))
            if not any(busy):
                break
            assert time.monotonic() < deadline, f"{server.base_url} still busy: {s}"
            time.sleep(0.2)
        flushed = httpx.post(f"{server.base_url}/flush_cache", timeout=30)
        assert flushed.status_code == 200, flushed.text
        assert state(server)["kv_used_tokens"] == 0, state(server)


@contextmanager
def link_socket(prefill: ServerProcess) -> Iterator[Any]:
    """A ZMQ DEALER connected to the prefill server's link port, as any process that reaches
    it could connect."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(state(prefill)["bootstrap_endpoint"])
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def both(pd: PD, path: str, body: dict[str, Any], room: int | None = None,
         timeout: float = 120) -> tuple[httpx.Response, httpx.Response]:
    """``body`` sent to the prefill and the decode server at once, as SGLang's router does."""
    room = random.getrandbits(63) if room is None else room
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port,
            "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(httpx.post, f"{s.base_url}{path}", json=body, timeout=timeout)
                   for s in (pd.prefill, pd.decode)]
        return replies[0].result(), replies[1].result()


# the bundled model behind the router, over each backend -----------------------------------------

@pytest.fixture(scope="module", params=["tcp", "mooncake"])
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[PD]:
    backend = request.param
    logs = tmp_path_factory.mktemp(f"pd-{backend}")
    # the two sides' page sizes differ, one way with each backend
    pages = ("1", "16") if backend == "tcp" else ("16", "1")
    # authenticated (the secret from the environment), so the decode server shares peer KV
    pd = start_pd([*REFERENCE_ARGS, "--disaggregation-transfer-backend", backend],
                  ["--page-size", pages[0]], ["--page-size", pages[1]], logs,
                  env={"SGL_DISAGGREGATION_SECRET": SECRET})
    try:
        with sgl_router(["--pd-disaggregation", "--prefill", pd.prefill.base_url,
                         "--decode", pd.decode.base_url, "--policy", "round_robin"],
                        logs / "router.log") as (url, _):
            pd.router, pd.backend = url, backend
            yield pd
            assert_idle(pd.prefill, pd.decode)
    finally:
        pd.prefill.stop()
        pd.decode.stop()


_answers: dict[str, Any] = {}


def one_server(server: ServerProcess, path: str, body: dict[str, Any]) -> Any:
    """The session's plain server's answer to ``body`` (asked once for both backends)."""
    key = f"{path} {json.dumps(body, sort_keys=True)}"
    if key not in _answers:
        reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        _answers[key] = reply.json()
    return _answers[key]


def test_generate_with_logprobs_equals_one_server(pd: PD, server: ServerProcess) -> None:
    body = {"text": "The three primary colors are", "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    via = httpx.post(f"{pd.router}/generate", json=body, timeout=120)
    assert via.status_code == 200, via.text
    a, b = via.json(), one_server(server, "/generate", body)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        got, want = a["meta_info"][key], b["meta_info"][key]
        assert [e[1] for e in got] == [e[1] for e in want], key
        for g, w in zip(got, want):
            assert (g[0] is None) == (w[0] is None) and abs((g[0] or 0) - (w[0] or 0)) < 1e-3
    # the first output token's top logprobs came from the prefill server with the KV
    assert [e[1] for e in a["meta_info"]["output_top_logprobs"][0]] == \
        [e[1] for e in b["meta_info"]["output_top_logprobs"][0]]


def test_chat_streaming_and_json_schema_equal_one_server(pd: PD, server: ServerProcess) -> None:
    from openai import OpenAI

    routed = OpenAI(base_url=f"{pd.router}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Name two animals that live in the sea."}]
    want = one_server(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 24,
        "temperature": 0})["choices"][0]["message"]["content"]
    got = routed.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                         temperature=0).choices[0].message.content
    assert got == want
    stream = routed.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "legs": {"type": "integer"}},
              "required": ["name", "legs"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema}}
    ask = [{"role": "user", "content": "Describe a cat as JSON."}]
    want = one_server(server, "/v1/chat/completions", {
        "model": MODEL, "messages": ask, "max_tokens": 40, "temperature": 0,
        "response_format": fmt})["choices"][0]["message"]["content"]
    got = routed.chat.completions.create(model=MODEL, messages=ask, max_tokens=40,
                                         temperature=0, response_format=fmt)
    assert got.choices[0].message.content == want
    assert set(json.loads(got.choices[0].message.content)) == {"name", "legs"}


def test_long_prompt_in_chunks_and_a_cached_prefix_is_not_sent_again(
        pd: PD, server: ServerProcess) -> None:
    """2,000 tokens (four chunks of 512) over tcp; 600 over mooncake, which is slower per page
    on its TCP transport (and the suite's time is short)."""
    rng = random.Random(7)
    n = 2000 if pd.backend == "tcp" else 600
    prompt = [rng.randrange(100, 40000) for _ in range(n)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    before = state(pd.decode)
    via = httpx.post(f"{pd.router}/generate", json=body, timeout=300)
    assert via.status_code == 200, via.text
    assert via.json()["output_ids"] == one_server(server, "/generate", body)["output_ids"]
    first = state(pd.decode)
    sent = first["kv_transfer_bytes"] - before["kv_transfer_bytes"]
    assert first["kv_transfers"] == before["kv_transfers"] + 1
    # SmolLM2 in float32: 30 layers x 3 KV heads x 64 x (K and V) x 4 bytes a token
    assert sent == (n - via.json()["meta_info"]["cached_tokens"]) * 30 * 3 * 64 * 2 * 4
    # the same prompt with another ending: its prefix is in the decode server's cache now
    keep = n * 3 // 4
    again = {**body, "input_ids": prompt[:keep] + prompt[:100]}
    via = httpx.post(f"{pd.router}/generate", json=again, timeout=300)
    assert via.status_code == 200, via.text
    cached = via.json()["meta_info"]["cached_tokens"]
    assert cached >= keep // 16 * 16, via.json()["meta_info"]  # whole pages of up to 16
    second = state(pd.decode)
    assert second["kv_transfer_bytes"] - first["kv_transfer_bytes"] == \
        (keep + 100 - cached) * 30 * 3 * 64 * 2 * 4
    assert via.json()["output_ids"] == one_server(server, "/generate", again)["output_ids"]


def test_an_unauthenticated_want_gets_no_kv(pd: PD) -> None:
    """With --disaggregation-secret, a want that does not carry its HMAC (here: for a room
    the prefill server holds, asking for the KV to go elsewhere) is answered "not
    authenticated" and changes nothing: the real decode server then gets the KV."""
    room = random.getrandbits(63)
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port,
              "bootstrap_room": room}
    body = {"input_ids": list(range(1000, 1100)), "sampling_params": {"max_new_tokens": 4},
            **fields}
    with link_socket(pd.prefill) as sock:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{pd.prefill.base_url}/generate", json=body,
                               timeout=120)
            time.sleep(1.0)  # prefilled, waiting for its decode server
            sock.send_json({"type": "want", "room": room, "dst": list(range(1, 101)),
                            "skip": 0, "agent": {"endpoint": "tcp://127.0.0.1:9"},
                            "layout": {}})
            assert sock.poll(10_000), "no answer"
            answer = json.loads(json.loads(sock.recv())["body"])
            assert answer["type"] == "failed" and answer["room"] == room
            assert "not authenticated" in answer["error"]
            assert "--disaggregation-secret" in answer["error"]
            decode = httpx.post(f"{pd.decode.base_url}/generate", json=body, timeout=120)
            prefill = held.result()
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert decode.json()["meta_info"]["completion_tokens"] == 4


def test_queues_and_transfers_are_reported(pd: PD) -> None:
    for server, mode in ((pd.prefill, "prefill"), (pd.decode, "decode")):
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
        assert info["disaggregation_mode"] == mode  # SGLang's key, which its router reads
        assert info["plugins"]["disaggregation"]["mode"] == mode
        if info["disaggregation_secret"] is not None:
            assert info["disaggregation_secret"] == "<hidden>"
        s = info["internal_states"][0]
        assert s["disaggregation_mode"] == mode and s["kv_transfers"] >= 1
        assert s["kv_transfer_failures"] == 0 and s["kv_transfer_bytes"] > 0
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        for name in ("sgl:num_transfer_reqs", "sgl:kv_transfer_bytes", "sgl:kv_transfers"):
            assert f"\n{name} " in metrics, name
    assert "num_bootstrap_reqs" in state(pd.decode)


# failures, on tiny models ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("pd-tiny") / "llama", "LlamaConfig",
                           {"vocab_size": 49152, "num_key_value_heads": 2,
                            "max_position_embeddings": 2048})


def tiny_args(model: Path) -> list[str]:
    return ["--model-path", str(model), "--dtype", "float32", "--max-total-tokens", "4096",
            "--context-length", "2048", "--disaggregation-timeout", str(TIMEOUT_S)]


@pytest.fixture(scope="module")
def failing(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    pd = start_pd(tiny_args(tiny), [], [], tmp_path_factory.mktemp("pd-fail"),
                  other_decode_args=["--dtype", "bfloat16"])
    yield pd
    for server in (pd.prefill, pd.decode, pd.other_decode):
        assert server is not None
        server.stop()


PROMPT = {"input_ids": list(range(1000, 1300)), "sampling_params": {"max_new_tokens": 4}}


def test_disaggregated_pair_without_router_works(failing: PD) -> None:
    prefill, decode = both(failing, "/generate", PROMPT)
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert decode.json()["meta_info"]["completion_tokens"] == 4
    assert decode.json()["output_ids"][0] == prefill.json()["output_ids"][0]
    assert_idle(failing.prefill, failing.decode)


def _one_side(server: ServerProcess, pd: PD, port: int | None = None,
              timeout: float = 60) -> tuple[httpx.Response, float]:
    body = {**PROMPT, "bootstrap_host": "127.0.0.1", "bootstrap_room": random.getrandbits(63),
            "bootstrap_port": port or pd.bootstrap_port}
    start = time.monotonic()
    reply = httpx.post(f"{server.base_url}/generate", json=body, timeout=timeout)
    return reply, time.monotonic() - start


def test_bootstrap_timeouts_end_requests_only_one_side_received(failing: PD) -> None:
    # the decode server alone: the prefill server never gets the request
    reply, took = _one_side(failing.decode, failing)
    assert reply.status_code in (502, 504), reply.text
    assert "bootstrap_room" in reply.text or "no KV from the prefill server" in reply.text
    assert took < TIMEOUT_S + 3, took
    # the prefill server alone: no decode server asks for the KV
    reply, took = _one_side(failing.prefill, failing)
    assert reply.status_code == 504, reply.text
    assert "no decode server asked for this request's KV" in reply.text
    assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 3, took
    assert state(failing.prefill)["kv_transfer_failures"] >= 1
    assert_idle(failing.prefill, failing.decode)


def test_unreachable_bootstrap_server_is_named(failing: PD) -> None:
    reply, took = _one_side(failing.decode, failing, port=free_port())
    assert reply.status_code == 502, reply.text
    assert "cannot reach the prefill server's bootstrap server" in reply.text
    assert took < 6, took
    assert_idle(failing.decode)


def test_decode_side_abort_frees_its_slots(failing: PD) -> None:
    """A client that gives up while the decode server waits for KV: the decode server asks
    the prefill server to stop, and frees the slots once it confirms."""
    room = random.getrandbits(63)
    body = {**PROMPT, "stream": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": failing.bootstrap_port, "bootstrap_room": room}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", f"{failing.decode.base_url}/generate", json=body,
                          timeout=httpx.Timeout(30, read=1.0)) as stream:
            for _ in stream.iter_lines():
                pass
    start = time.monotonic()
    assert_idle(failing.decode, within=TIMEOUT_S / 2)  # the cancel is confirmed, not timed out
    assert time.monotonic() - start < TIMEOUT_S / 2
    # the prefill server remembers: that room's request, arriving late, ends once prefilled
    # instead of holding its KV for a decode server that will not ask
    reply = httpx.post(f"{failing.prefill.base_url}/generate", timeout=30, json={
        **PROMPT, **{k: body[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}})
    assert reply.status_code == 499 and "gave the request up" in reply.text, reply.text
    assert time.monotonic() - start < TIMEOUT_S
    assert_idle(failing.prefill)


def test_a_failed_transfer_ends_the_request_on_both_sides(failing: PD) -> None:
    """A decode server whose KV pool is laid out differently (bfloat16 against float32): the
    prefill side refuses to write, and both requests end with the reason."""
    mismatched = PD(failing.prefill, failing.other_decode, failing.bootstrap_port)
    prefill, decode = both(mismatched, "/generate", PROMPT)
    assert prefill.status_code == decode.status_code == 502, (prefill.text, decode.text)
    for reply in (prefill, decode):
        assert "KV layout" in reply.text and "same --dtype" in reply.text, reply.text
    assert state(failing.prefill)["kv_transfer_failures"] >= 1
    assert_idle(failing.prefill, failing.other_decode)


def test_bootstrap_fields_are_checked(failing: PD, server: ServerProcess) -> None:
    plain = httpx.post(f"{failing.decode.base_url}/generate", json=PROMPT, timeout=30)
    assert plain.status_code == 400 and "this is a decode server" in plain.text
    plain = httpx.post(f"{failing.prefill.base_url}/generate", json=PROMPT, timeout=30)
    assert plain.status_code == 400 and "this is a prefill server" in plain.text
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 5}
    normal = httpx.post(f"{server.base_url}/generate", json={**PROMPT, **fields}, timeout=30)
    assert normal.status_code == 400 and "not disaggregated" in normal.text
    for bad, says in (({"bootstrap_room": "x"}, "bootstrap_room must be an integer"),
                      ({"bootstrap_port": 70000}, "bootstrap_port must be a port"),
                      ({"bootstrap_host": None}, "bootstrap_host is required")):
        reply = httpx.post(f"{failing.decode.base_url}/generate",
                           json={**PROMPT, **fields, **bad}, timeout=30)
        assert reply.status_code == 400 and says in reply.text, reply.text
    n2 = {**PROMPT, **fields, "sampling_params": {"max_new_tokens": 2, "n": 2}}
    reply = httpx.post(f"{failing.decode.base_url}/generate", json=n2, timeout=30)
    assert reply.status_code == 400 and "a list of 2 rooms" in reply.text, reply.text


def test_a_repeated_room_on_the_prefill_server_is_refused(failing: PD) -> None:
    """A second request with a room the prefill server holds took the first's place in its
    table, and the first's row and KV were never freed: 64 such requests stopped admission
    (issue 55). It is a 400 now; the first ends as it would alone."""
    room = random.getrandbits(63)
    body = {**PROMPT, "bootstrap_host": "127.0.0.1", "bootstrap_room": room,
            "bootstrap_port": failing.bootstrap_port}
    url = f"{failing.prefill.base_url}/generate"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, url, json=body, timeout=60)
        time.sleep(1.0)  # the first is held (waiting for a decode server to ask)
        again = httpx.post(url, json=body, timeout=60)
        assert again.status_code == 400, again.text
        assert f"bootstrap_room {room} is already in use" in again.text
        assert first.result().status_code == 504  # no decode server asked, as alone
    assert_idle(failing.prefill)


def test_malformed_link_messages_leave_the_link_serving(failing: PD) -> None:
    """Messages any process that reaches the prefill server's link port can send: each is
    dropped with a warning, and the pair serves as before. One malformed message used to end
    the link thread, after which the scheduler's next command to it blocked for good."""
    with link_socket(failing.prefill) as sock:
        for frames in ([b"one", b"two"],  # three frames at the ROUTER
                       [b'{"type": "want", "room": 1e400}'], [b'{"type": "want"}'],
                       [b'{"room": 7}'], [b"not json"], [b"[1, 2]"], [b"\xff\xfe"],
                       [b'{"type": "want", "room": true}'], [b'{"type": "cancel", "room": -1}']):
            sock.send_multipart(frames)
        # a want for a room the prefill server holds, in another layout: that request fails
        room = random.getrandbits(63)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{failing.prefill.base_url}/generate", timeout=60,
                               json={**PROMPT, "bootstrap_host": "127.0.0.1", "bootstrap_room":
                                     room, "bootstrap_port": failing.bootstrap_port})
            time.sleep(1.0)
            sock.send_json({"type": "want", "room": room, "skip": "x", "dst": 7,
                            "layout": {"not": "this one"}})
            reply = held.result()
        assert reply.status_code == 502, reply.text
        assert "layout" in reply.text
        # a flood of wants for rooms nobody holds: past MAX_PENDING_ROOMS each is refused
        for room in range(5000):
            sock.send_json({"type": "want", "room": room, "dst": [], "skip": 0})
        refused = 0
        while sock.poll(3000):
            answer = json.loads(sock.recv())
            refused += "holds 4096 wants already" in answer.get("error", "")
        assert refused == 5000 - 4096
    prefill, decode = both(failing, "/generate", PROMPT)
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert_idle(failing.prefill, failing.decode)


def test_a_prefill_host_not_allowed_is_refused_before_any_fetch(failing: PD) -> None:
    """The decode server takes KV only from the prefill servers --disaggregation-prefill-host
    names (default: loopback): any other bootstrap_host is a 400 at once, nothing fetched."""
    for host in ("10.9.8.7", "prefill.example.com", "169.254.169.254"):
        start = time.monotonic()
        reply = httpx.post(f"{failing.decode.base_url}/generate", timeout=30, json={
            **PROMPT, "bootstrap_host": host, "bootstrap_port": 80,
            "bootstrap_room": random.getrandbits(63)})
        assert reply.status_code == 400, reply.text
        assert "--disaggregation-prefill-host" in reply.text and "loopback" in reply.text
        assert time.monotonic() - start < 2
    assert_idle(failing.decode)


class _Impostor(BaseHTTPRequestHandler):
    """Something on an allowed host that is not a bootstrap server."""

    answers: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802
        status, headers, body = self.answers[self.server.server_port]  # type: ignore[index]
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_bootstrap_answer_that_is_not_sgls_is_refused_unquoted(failing: PD) -> None:
    """A listener on an allowed host: a redirect is not followed, a huge answer is not read
    whole, an endpoint that is not tcp:// is not dialled, and its content is never quoted in
    the error (it was reflected into the 502 before)."""
    marker = "IMPOSTOR-SECRET-42"
    cases = [(302, {"Location": f"http://127.0.0.1:{failing.bootstrap_port}/route"}, b""),
             (200, {}, json.dumps({"endpoint": "ipc:///tmp/sgl", "x": marker}).encode()),
             (200, {}, b'{"endpoint": "tcp://127.0.0.1:1", "pad": "' + b"a" * 100_000
              + marker.encode() + b'"}'),
             (500, {}, marker.encode())]
    for answer in cases:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
        _Impostor.answers[httpd.server_port] = answer
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            reply, took = _one_side(failing.decode, failing, port=httpd.server_port)
        finally:
            httpd.shutdown()
            httpd.server_close()
        assert reply.status_code == 502, (answer[0], reply.text)
        assert "is not an sgl bootstrap server" in reply.text, reply.text
        assert marker not in reply.text and "/route" in reply.text
        assert took < 6
    assert_idle(failing.decode)


def test_kv_that_is_not_finite_is_refused(failing: PD) -> None:
    """A hostile prefill server (sgl's own bootstrap server and tcp backend, answering like a
    prefill server but writing NaN rows): the decode server finds the rows not finite and
    fails the request with a 502 instead of decoding from them, or caching them."""
    import torch
    import zmq
    from sgl_transfer_tcp.backend import TcpKVTransfer

    from sgl_disaggregation.bootstrap import BootstrapServer
    from sgl.transfer import KVBuffers

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    bootstrap = BootstrapServer("127.0.0.1", free_port(),
                                {"endpoint": f"tcp://127.0.0.1:{port}"})
    box: dict[str, Any] = {}

    def serve_one_want() -> None:
        if not router.poll(30_000):
            return
        identity, raw = router.recv_multipart()
        want = json.loads(raw)
        layout, dst = want["layout"], want["dst"]
        dtype = getattr(torch, layout["dtype"])
        rows = len(dst) + 1
        buffers = KVBuffers([torch.full((rows, b // dtype.itemsize), float("nan"), dtype=dtype)
                             for b in layout["row_bytes"]])
        writer = TcpKVTransfer(buffers, role="prefill", host="127.0.0.1")
        try:
            box["bytes"] = writer.write(want["agent"], want["room"], list(range(1, rows)), dst,
                                        timeout=10)
        finally:
            writer.close()
        router.send_multipart([identity, json.dumps({
            "type": "done", "room": want["room"], "token": 5, "bytes": box["bytes"],
            "seconds": 0.0}).encode()])

    thread = threading.Thread(target=serve_one_want, daemon=True)
    thread.start()
    try:
        reply, _ = _one_side(failing.decode, failing,
                             port=bootstrap.httpd.server_address[1])
        thread.join(timeout=30)
    finally:
        bootstrap.close()
        router.close()
        ctx.term()
    assert box.get("bytes", 0) > 0  # the NaN rows did land in the decode server's slots
    assert reply.status_code == 502, reply.text
    assert "not finite" in reply.text, reply.text
    assert_idle(failing.decode)


def test_without_a_secret_peer_kv_serves_its_request_only(failing: PD) -> None:
    """No --disaggregation-secret: the decode server cannot tell its peers from anyone, so
    the KV it is sent never enters its prefix cache; the same prompt again is transferred
    whole again (with the secret, tests of the `pd` fixture see it cached)."""
    moved = []
    for _ in range(2):
        before = state(failing.decode)["kv_transfer_bytes"]
        prefill, decode = both(failing, "/generate", PROMPT)
        assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
        assert decode.json()["meta_info"]["cached_tokens"] == 0
        moved.append(state(failing.decode)["kv_transfer_bytes"] - before)
    assert moved[0] == moved[1] > 0
    assert_idle(failing.prefill, failing.decode)


def test_a_message_past_the_size_limit_drops_only_its_sender(failing: PD) -> None:
    """A 33 MiB message to the prefill server's link port (the limit is 32 MiB): ZMQ drops
    that connection, and the pair serves as before."""
    with link_socket(failing.prefill) as sock:
        sock.send(b'{"type": "want", "room": 1, "pad": "' + b"a" * (33 << 20) + b'"}')
        time.sleep(1.0)
    prefill, decode = both(failing, "/generate", PROMPT)
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert_idle(failing.prefill, failing.decode)


def test_prefill_killed_while_decode_waits(failing: PD) -> None:
    """A prefill server that dies (SIGKILL, its scheduler too) while a decode server waits for
    its KV: the decode server notices it is gone and ends the request well within the
    timeout. The last test of the `failing` pair: its prefill server is dead after it."""
    box: dict[str, Any] = {}

    def ask() -> None:
        box["reply"], box["took"] = _one_side(failing.decode, failing)

    thread = threading.Thread(target=ask)
    thread.start()
    deadline = time.monotonic() + 10
    while state(failing.decode)["num_transfer_reqs"] == 0:  # its want is out
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _kill_tree(failing.prefill.proc.pid)
    killed = time.monotonic()
    thread.join(timeout=30)
    reply = box["reply"]
    assert reply.status_code == 502, reply.text
    assert "is gone" in reply.text, reply.text
    assert time.monotonic() - killed < TIMEOUT_S, "noticed by the health check, not timeout"
    assert_idle(failing.decode)


def _kill_tree(pid: int) -> None:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                              text=True).stdout.split()
    for p in [pid, *map(int, children)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# flags ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--disaggregation-transfer-backend", "tcp"], "it needs --disaggregation-mode"),
    (["--disaggregation-mode", "prefill", "--dp-size", "2"],
     "data parallelism with --disaggregation-mode is not built yet"),
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"],
     "no installed plugin provides that KV transfer backend; available: "),
    (["--disaggregation-mode", "banana"], "banana"),
    (["--disaggregation-secret", "0123456789abcdef"], "it needs --disaggregation-mode"),
    (["--disaggregation-mode", "decode", "--disaggregation-secret", "short"],
     "at least 16 characters"),
    (["--disaggregation-mode", "prefill", "--disaggregation-prefill-host", "127.0.0.1"],
     "only a decode server takes KV"),
    (["--disaggregation-mode", "decode", "--disaggregation-prefill-host", "a b"],
     "'a b' is not a host name"),
    (["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"],
     "'disaggregation_bootstrap_port': expected 1-65535"),
    (["--disaggregation-mode", "decode", "--disaggregation-timeout", "0"],
     "'disaggregation_timeout': expected at least 0.1"),
    (["--load-balance-method", "cache_aware"], "it needs --dp-size above 1"),
    (["--disable-plugin", "disaggregation", "--disaggregation-mode", "prefill"],
     "No such option '--disaggregation-mode'. If it is a plugin's option, that plugin is not "
     "loaded"),
])
def test_bad_disaggregation_flags_are_named(args: list[str], says: str) -> None:
    result = run_cli(["serve", "--port", str(free_port()), *args], timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert says in result.stderr, result.stderr


@pytest.mark.parametrize("args, says", [
    (["--prefill", "http://127.0.0.1:1"], "add --pd-disaggregation"),
    (["--pd-disaggregation", "--prefill", "http://127.0.0.1:1"], "one --decode URL"),
    (["--pd-disaggregation", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
     "--prefill 127.0.0.1:1: expected http://HOST:PORT"),
    (["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode",
      "http://127.0.0.1:2", "--workers", "2"], "are for the regular mode"),
])
def test_bad_pd_router_arguments_are_named(args: list[str], says: str) -> None:
    result = run_cli(["router", "--port", str(free_port()), *args], timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert says in result.stderr, result.stderr

