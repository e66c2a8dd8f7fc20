"""One hostile request must not stop or starve the server (issue 55): each attack below is sent
to the session's real server while a canary client asks for a few greedy tokens every half
second; the attack gets a 4xx or a bounded answer, no canary request waits more than a few
seconds, and the server answers normally afterwards.

Each case took the server down or blocked every client before its fix: the JSON pre-check
rescanned an unterminated string from every quote (200 KB: 118 s on the event loop),
``stop_regex`` backtracked in the scheduler's loop (61 s), and logprob requests of the
vocabulary's size built tens of GB of tuples (the scheduler was OOM-killed).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest

from sgl_testing import ServerProcess

pytestmark = pytest.mark.slow

#: the longest a canary request may take while an attack runs (a 2-core CI machine included)
CANARY_LIMIT_S = 10.0
#: the most the server's processes may grow while an attack runs (the logprob attack grew the
#: scheduler by 14 GB before its fix)
MEMORY_LIMIT = 1 << 30


def server_rss(server: ServerProcess) -> int:
    """Resident bytes of the server's processes, its grammar compile workers left out (each
    has its own cap, --grammar-compile-memory-mb, and is killed past it)."""
    root = psutil.Process(server.proc.pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            if "sgl.grammar.worker" not in " ".join(proc.cmdline()):
                total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


@contextmanager
def canary(server: ServerProcess, limit_s: float = CANARY_LIMIT_S) -> Iterator[list[float]]:
    """A client asking for 4 greedy tokens every half second, watching the server's memory;
    yields the latencies so far."""
    latencies: list[float] = []
    errors: list[str] = []
    stop = threading.Event()
    baseline, peak = server_rss(server), [0]

    def run() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                start = time.monotonic()
                try:
                    response = client.post(f"{server.base_url}/generate", json={
                        "text": "The capital of France is",
                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
                    if response.status_code != 200:
                        errors.append(f"{response.status_code}: {response.text[:200]}")
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                latencies.append(time.monotonic() - start)
                peak[0] = max(peak[0], server_rss(server))
                stop.wait(0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(timeout=150)
    assert not thread.is_alive(), "a canary request never came back"
    assert not errors, f"canary requests failed: {errors[:3]}"
    assert latencies and max(latencies) < limit_s, (
        f"a canary request waited {max(latencies):.1f} s while the attack ran")
    peak[0] = max(peak[0], server_rss(server))
    assert peak[0] - baseline < MEMORY_LIMIT, (
        f"the server grew by {(peak[0] - baseline) >> 20} MiB while the attack ran")


def attack(server: ServerProcess, send: Callable[[httpx.Client], httpx.Response],
           limit_s: float = 30.0, canary_limit_s: float = CANARY_LIMIT_S) -> httpx.Response:
    """``send`` under the canary; the attack itself must be answered within ``limit_s``."""
    with canary(server, canary_limit_s):
        time.sleep(0.6)  # the canary is running
        start = time.monotonic()
        with httpx.Client(timeout=limit_s + 30) as client:
            response = send(client)
        took = time.monotonic() - start
        time.sleep(0.6)  # and still is
    assert took < limit_s, f"the attack was answered after {took:.1f} s"
    health = httpx.get(f"{server.base_url}/health_generate", timeout=60)
    assert health.status_code == 200, "the server does not generate after the attack"
    return response


@pytest.mark.parametrize("brackets", [10, 65])
def test_unterminated_string_of_escaped_quotes(server: ServerProcess, brackets: int) -> None:
    """200 KB of ``\\"`` after a quote that never closes: the depth pre-check is one pass."""
    body = b"[" * brackets + b'"' + b'\\"' * 100_000
    response = attack(server, lambda c: c.post(
        f"{server.base_url}/generate", content=body,
        headers={"content-type": "application/json"}), limit_s=5)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_backtracking_stop_regex(server: ServerProcess) -> None:
    """``(a|aa)+b`` over a run of forced ``a``: RE2 matches it in linear time."""
    response = attack(server, lambda c: c.post(f"{server.base_url}/generate", json={
        "text": "Say a", "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "regex": "a{40}",
            "stop_regex": "(a|aa)+b"}}), limit_s=20)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == "a" * 40


def test_stop_regex_re2_cannot_run_is_a_400(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 2, "stop_regex": r"(a)\1"}})
    assert response.status_code == 400, response.text
    assert "stop_regex" in response.json()["error"]["message"]
    assert "RE2" in response.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [
    ("top_logprobs_num", 49152),
    ("token_ids_logprob", list(range(49152)) * 20),  # 983,040 ids
])
def test_logprobs_of_the_whole_vocabulary(server: ServerProcess, field: str, value) -> None:
    """Per-position logprobs are capped (--max-logprobs, 20): a prompt's every position times
    the vocabulary would be hundreds of millions of entries."""
    prompt = "hello " * 1800
    response = attack(server, lambda c: c.post(f"{server.base_url}/generate", json={
        "text": prompt, "return_logprob": True, "logprob_start_len": 0, field: value,
        "sampling_params": {"max_new_tokens": 1}}), limit_s=20)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "--max-logprobs" in error["message"]


def test_thousands_of_stop_strings(server: ServerProcess) -> None:
    """Every stop string is looked for after every token: their count and length are capped."""
    many = [f"stop{i}" for i in range(10_000)]
    response = attack(server, lambda c: c.post(f"{server.base_url}/generate", json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 2, "stop": many}}), limit_s=20)
    assert response.status_code == 400, response.text
    assert "stop" in response.json()["error"]["message"]
    long = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 2, "stop": ["x" * 5000]}})
    assert long.status_code == 400, long.text


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_prompt_too_long_to_fit_is_refused_before_tokenizing(server: ServerProcess,
                                                             path: str) -> None:
    """30 MB of text cannot fit SmolLM2's 8192 tokens whatever the tokenization: a 400 by size,
    not seconds of tokenizing on the event loop."""
    text = "word " * 6_000_000
    body = ({"text": text, "sampling_params": {"max_new_tokens": 1}} if path == "/generate"
            else {"model": "default", "max_tokens": 1,
                  "messages": [{"role": "user", "content": text}]})
    response = attack(server, lambda c: c.post(f"{server.base_url}{path}", json=body),
                      limit_s=10)
    assert response.status_code == 400, response.text[:300]
    assert "characters" in response.text


def test_batch_times_n_is_capped_before_it_is_expanded(server: ServerProcess) -> None:
    """64 prompts of 8,000 ids with n = 128: the split would copy half a billion ids before
    the context-length check; the count of sequences is checked first."""
    ids = [1] * 8000
    response = attack(server, lambda c: c.post(f"{server.base_url}/generate", json={
        "input_ids": [ids] * 64, "sampling_params": {"max_new_tokens": 1, "n": 128}}),
        limit_s=10)
    assert response.status_code == 400, response.text[:300]
    assert "4096" in response.json()["error"]["message"]


def test_long_prompts_are_tokenized_off_the_event_loop(server: ServerProcess) -> None:
    """Six prompts of 2.4 M characters at once (just under the size bound; about 1.5 s each to
    tokenize, then refused: 400,000 tokens do not fit the context). They queue on the
    long-prompt tokenizer thread; the canary's short prompts are tokenized on the other and
    never wait 3 s (on the event loop, the six held every request for about 9 s)."""
    body = {"text": "a" * 2_400_000, "sampling_params": {"max_new_tokens": 1}}

    def send(client: httpx.Client) -> httpx.Response:
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(
                lambda _: client.post(f"{server.base_url}/generate", json=body), range(6)))
        for response in responses:
            assert response.status_code == 400, response.text[:300]
            assert "context length" in response.json()["error"]["message"]
        return responses[0]

    attack(server, send, limit_s=60, canary_limit_s=3.0)


def own_server(tmp_path_factory: pytest.TempPathFactory, name: str,
               *args: str) -> Iterator[ServerProcess]:
    """A server of this module's own, with ``args`` besides a small KV pool."""
    proc = ServerProcess(*args, "--max-total-tokens", "4096",
                         log_path=tmp_path_factory.mktemp(name) / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose requests may take 3 seconds (--request-timeout)."""
    yield from own_server(tmp_path_factory, "timed", "--request-timeout", "3")


LONG = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}


def test_a_request_past_its_deadline_is_aborted(timed_server: ServerProcess) -> None:
    url = timed_server.base_url
    start = time.monotonic()
    response = httpx.post(f"{url}/generate", timeout=60,
                          json={"text": "Count to a million:", "sampling_params": LONG})
    took = time.monotonic() - start
    assert response.status_code == 504, response.text
    assert "--request-timeout" in response.json()["error"]["message"]
    assert 2.5 < took < 10
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 4000, "messages": [{"role": "user", "content": "Hi"}],
        "ignore_eos": True})
    assert chat.status_code == 504, chat.text
    # a stream ends with an error event
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "default", "max_tokens": 4000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert any("--request-timeout" in e for e in events), events[-3:]
    # the aborted requests' memory is free, and a short request runs
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0]
        if info["num_running_reqs"] == 0 and info.get("num_used_tokens", 0) == 0:
            break
        time.sleep(0.2)
    assert info["num_running_reqs"] == 0, info
    short = httpx.post(f"{url}/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert short.status_code == 200, short.text
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "sgl:num_request_timeouts_total 3.0" in metrics


@pytest.fixture(scope="module")
def strict_grammar_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose constraints may take 2 seconds to compile (--grammar-compile-timeout)."""
    yield from own_server(tmp_path_factory, "grammar", "--grammar-compile-timeout", "2")


def test_a_constraint_too_costly_to_compile(strict_grammar_server: ServerProcess) -> None:
    """A regex of 100,000 alternatives (800 KB) takes xgrammar (the default backend) about 14 s
    and 100 MB to compile on a Sapphire Rapids core: its compile worker is killed at
    --grammar-compile-timeout, the request gets a 400 naming the flag, the canary never waits,
    and the next constraint compiles in a fresh worker."""
    server = strict_grammar_server
    url = server.base_url
    regex = "(" + "|".join(f"x{i}" for i in range(100_000)) + ")"
    response = attack(server, lambda c: c.post(f"{url}/generate", json={
        "text": "Say x1", "sampling_params": {"max_new_tokens": 4, "regex": regex}}),
        limit_s=20)
    assert response.status_code == 400, response.text[:300]
    assert "--grammar-compile-timeout" in response.json()["error"]["message"]
    after = httpx.post(f"{url}/generate", timeout=60, json={
        "text": "Say 7", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}})
    assert after.status_code == 200, after.text
    assert after.json()["text"].isdigit()
    info = httpx.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0]
    assert info["grammar_compile_workers_lost"] == 1
