"""The scheduler with the real SmolLM2, driven in-process step by step over its real ZMQ
sockets: continuous batching, retraction, chunked prefill, abort, stop strings, seeds,
logprobs (against transformers) and bad input."""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from sgl.config import load_settings
from sgl.engine.messages import (AbortRequest, GenerateRequest, LogprobOptions, TokenBatch,
                                 TokenOutput)
from sgl.engine.scheduler_process import build_scheduler
from sgl.plugins import SglPluginManager, create_plugin_manager
from sgl.sampling import SamplingParams
from sgl_testing import CAPITAL_QUESTION

pytestmark = pytest.mark.slow
POOL_TOKENS = 1200
_ids = itertools.count()


@dataclass
class Result:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    cached_tokens: int = 0
    input_token_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[Any] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)


class Harness:
    """A Scheduler in this process; the test plays the server's side of the sockets."""

    def __init__(self, tmp: Path, pm: SglPluginManager | None = None, **overrides: Any) -> None:
        # The tests built on this harness compare outputs token for token across batch
        # compositions (with and without the cache, speculation, retraction); the default
        # int8 activations (rounded for the GGUF at kernel levels) keep a row's result its own
        # at any batch size, as the exact products do.
        # Decode forwards of batch sizes 1-4 are recorded at start-up (the default, up to 48
        # here, would take seconds per harness; tests/plugins/kernels/test_cpu_graph.py tests
        # the default).
        settings = load_settings(env={}, cli={
            "dtype": "float32", "max_total_tokens": POOL_TOKENS, "max_running_requests": 48,
            "chunked_prefill_size": 512, "num_threads": 1, "cpu_graph_max_bs": 4, **overrides})
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # closing never waits for a gone peer
        endpoints = {"requests": f"ipc://{tmp}/req", "outputs": f"ipc://{tmp}/out"}
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(endpoints["requests"])
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(endpoints["outputs"])
        self.scheduler = build_scheduler(settings, pm or create_plugin_manager(), endpoints)
        self.tokenizer = self.scheduler.tokenizer
        #: the final output of every request seen to finish (run, receive)
        self.finished: dict[str, TokenOutput] = {}

    def chat_ids(self, question: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def submit(self, input_ids: list[int], logprobs: LogprobOptions | None = None,
               session_id: str | None = None, **params: Any) -> str:
        rid = f"r{next(_ids)}"
        self.push.send_pyobj(GenerateRequest(rid, list(input_ids), SamplingParams(**params),
                                             logprobs or LogprobOptions(), time.time(),
                                             session_id=session_id))
        return rid

    def run(self, rids: list[str], *, abort: dict[str, int] | None = None,
            max_steps: int = 5000) -> dict[str, Result]:
        results = {rid: Result() for rid in rids}
        s = self.scheduler
        for step in range(max_steps):
            s.recv_requests(block=False)
            s.step()
            for rid, at in (abort or {}).items():
                if step == at:
                    self.push.send_pyobj(AbortRequest(rid))
            for out in self.receive():
                if out.rid not in results:
                    raise AssertionError(self.stray(out, step))
                r = results[out.rid]
                r.output_ids += out.new_token_ids
                r.finish_reason, r.error = out.finish_reason, out.error
                r.cached_tokens = out.cached_tokens
                for name in ("input_token_logprobs", "output_token_logprobs",
                             "input_top_logprobs", "output_top_logprobs"):
                    getattr(r, name).extend(getattr(out, name))
            done = all(r.finish_reason for rid, r in results.items() if rid not in (abort or {}))
            if done and s.idle:
                return results
        raise AssertionError("requests did not finish")

    def receive(self) -> list[TokenOutput]:
        """The outputs that have arrived, noting which requests they finish."""
        outputs = []
        while self.pull.poll(0):
            batch: TokenBatch = self.pull.recv_pyobj()
            for out in batch.outputs:
                if out.finish_reason is not None:
                    self.finished[out.rid] = out
                outputs.append(out)
        return outputs

    def stray(self, out: TokenOutput, step: int) -> str:
        """What to say of an output for a request that is not one of this run's."""
        before = self.finished.get(out.rid)
        history = (f"it had finished earlier ({before.finish_reason}, "
                   f"{before.completion_tokens} tokens)" if before is not None
                   else "no output of it had ended it")
        return (f"step {step}: an output for {out.rid}, not a request of this run; {history}; "
                f"this one: {out.new_token_ids} new tokens, finish {out.finish_reason}, "
                f"{out.completion_tokens} tokens, error {out.error}")

    def assert_memory_empty(self) -> None:
        """Every slot is either free or held (unlocked) by the prefix cache, and after a flush
        every slot is free again."""
        s = self.scheduler
        assert s.idle
        pool = s.runner.kv_pool
        assert pool.num_free + s.cache.cached_tokens == pool.size
        assert s.cache.evictable_tokens == s.cache.cached_tokens  # nothing locked
        assert s.flush_cache()["success"]
        assert s.runner.kv_pool.num_free == s.runner.kv_pool.size
        assert s.runner.req_to_token_pool.num_free == s.runner.req_to_token_pool.max_requests

    def close(self) -> None:
        self.scheduler.close()
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(tmp_path_factory.mktemp("sched"))
    with torch.inference_mode():
        yield h
    h.close()


def one(h: Harness, input_ids: list[int], **kw: Any) -> Result:
    rid = h.submit(input_ids, **kw)
    return h.run([rid])[rid]


QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
    "What is 12 times 12?", "Who wrote Hamlet?", "Explain gravity in one sentence.",
    "List the planets of the solar system.", "What is the boiling point of water?",
]


def mixed_prompts(h: Harness, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(count):
        ids = h.chat_ids(QUESTIONS[i % len(QUESTIONS)] + " Please answer." * (i % 5))
        if i % 4 == 3:  # some long ones, with random filler before the question
            ids = torch.randint(100, 40000, (100 + 8 * i,), generator=gen).tolist() + ids
        prompts.append(ids)
    return prompts


def test_concurrent_requests_match_each_alone_with_retraction(harness: Harness) -> None:
    prompts = mixed_prompts(harness, 40)
    lengths = [8 + (i % 4) * 4 for i in range(40)]
    before = harness.scheduler.num_retractions
    # admission expects requests to use 10% of their max_new_tokens: they use all of it, the
    # small pool runs out mid-decode, and the scheduler must retract
    harness.scheduler.new_token_ratio = 0.1
    rids = [harness.submit(p, max_new_tokens=n, temperature=0) for p, n in zip(prompts, lengths)]
    together = harness.run(rids)
    assert harness.scheduler.num_retractions > before, "the small KV pool should force retraction"
    harness.assert_memory_empty()
    for rid, prompt, n in zip(rids, prompts, lengths):
        alone = one(harness, prompt, max_new_tokens=n, temperature=0)
        assert together[rid].output_ids == alone.output_ids
        assert together[rid].finish_reason == alone.finish_reason
    harness.assert_memory_empty()


def test_chunked_prefill_matches_unchunked(harness: Harness) -> None:
    prompt = mixed_prompts(harness, 24)[23]
    assert len(prompt) > 250
    s = harness.scheduler
    try:
        s.chunk_size = 64
        chunked = one(harness, prompt, max_new_tokens=12, temperature=0,
                      logprobs=LogprobOptions(True, 0, 0, None))
        s.chunk_size = 100_000
        whole = one(harness, prompt, max_new_tokens=12, temperature=0,
                    logprobs=LogprobOptions(True, 0, 0, None))
    finally:
        s.chunk_size = 512
    assert chunked.output_ids == whole.output_ids
    assert len(chunked.input_token_logprobs) == len(prompt)
    got = torch.tensor([e[0] for e in chunked.input_token_logprobs[1:]])
    want = torch.tensor([e[0] for e in whole.input_token_logprobs[1:]])
    # 64-token chunks go through sgl's float32 panel matmul, the whole prompt through MKL: the
    # same sums in another order, so equal to float32 rounding (measured: 7.5e-5 relative)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-4)


def test_abort_frees_memory_at_once(harness: Harness) -> None:
    keep = harness.submit(harness.chat_ids("Name three colors."), max_new_tokens=6, temperature=0)
    gone = harness.submit(harness.chat_ids("Tell me a long story."), max_new_tokens=500,
                          temperature=0)
    results = harness.run([keep, gone], abort={gone: 3})
    assert len(results[keep].output_ids) == 6
    assert len(results[gone].output_ids) < 20
    harness.assert_memory_empty()


def test_stop_string_spanning_tokens(harness: Harness) -> None:
    prompt = harness.chat_ids(CAPITAL_QUESTION)
    free = one(harness, prompt, max_new_tokens=16, temperature=0)
    pieces = [harness.tokenizer.decode([t]) for t in free.output_ids]
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]  # ends inside token k+1, starts inside token k
    stopped = one(harness, prompt, max_new_tokens=16, temperature=0, stop=[stop])
    assert stopped.finish_reason == {"type": "stop", "matched": stop}
    assert stopped.output_ids == free.output_ids[:k + 2]


def test_stop_regex(harness: Harness) -> None:
    """SGLang's stop_regex (its frontend language sends it): the output ends at the first token
    after which its end matches the pattern; finish_reason carries the matched text."""
    prompt = harness.chat_ids(CAPITAL_QUESTION)
    free = one(harness, prompt, max_new_tokens=16, temperature=0)
    text = harness.tokenizer.decode(free.output_ids)
    word = next(w for w in text.split() if len(w) >= 4 and w.isalpha())
    pattern = word[0] + "[a-z]+" + word[-1]  # matches the word, not as a plain string
    stopped = one(harness, prompt, max_new_tokens=16, temperature=0, stop_regex=[pattern])
    assert stopped.finish_reason["type"] == "stop"
    assert re.fullmatch(pattern, stopped.finish_reason["matched"])
    assert free.output_ids[:len(stopped.output_ids)] == stopped.output_ids
    assert len(stopped.output_ids) < len(free.output_ids)


def test_eos_and_min_new_tokens(harness: Harness) -> None:
    prompt = harness.chat_ids("Say just the word yes.")
    short = one(harness, prompt, max_new_tokens=64, temperature=0)
    assert short.finish_reason["type"] == "stop"
    n = len(short.output_ids)
    longer = one(harness, prompt, max_new_tokens=64, min_new_tokens=n + 5, temperature=0)
    assert len(longer.output_ids) >= n + 5
    ignored = one(harness, prompt, max_new_tokens=n + 3, ignore_eos=True, temperature=0)
    assert len(ignored.output_ids) == n + 3 and ignored.finish_reason["type"] == "length"


def test_seeded_sampling_is_reproducible_and_unseeded_varies(harness: Harness) -> None:
    prompt = harness.chat_ids("Write a short poem about the sea.")
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    a = one(harness, prompt, seed=1234, **params)
    # the same seed inside a busy batch still gives the same tokens
    rids = [harness.submit(prompt, seed=1234, **params)] + [
        harness.submit(harness.chat_ids(q), max_new_tokens=5, temperature=1.0) for q in QUESTIONS[:3]]
    b = harness.run(rids)[rids[0]]
    assert a.output_ids == b.output_ids
    unseeded = [one(harness, prompt, **params).output_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1


def test_prefill_only_returns_prompt_logprobs(harness: Harness) -> None:
    prompt = harness.chat_ids("Hello!")
    r = one(harness, prompt, max_new_tokens=0, logprobs=LogprobOptions(True, 0, 2, [1, 2]))
    assert r.output_ids == [] and r.finish_reason == {"type": "length", "length": 0}
    assert len(r.input_token_logprobs) == len(prompt)
    assert r.input_token_logprobs[0] == (None, prompt[0], None)
    assert r.input_top_logprobs[0] is None and len(r.input_top_logprobs[1]) == 2
    harness.assert_memory_empty()


def test_logprobs_agree_with_transformers(tmp_path: Path, smollm2_reference: Any) -> None:
    """Every product exact (transformers multiplies the dequantized weights by float32 x), the
    logprobs of the prompt and of the answer are transformers' to 2e-3."""
    reference = smollm2_reference
    harness = Harness(tmp_path, int8_activations="off")
    try:
        prompt = harness.chat_ids(CAPITAL_QUESTION)
        with torch.inference_mode():
            r = one(harness, prompt, max_new_tokens=6, temperature=0,
                    logprobs=LogprobOptions(True, 3, 5, None))
    finally:
        harness.close()
    full = prompt + r.output_ids
    with torch.no_grad():
        want = torch.log_softmax(reference(torch.tensor([full])).logits[0].float(), dim=-1)
    got_in = [e[0] for e in r.input_token_logprobs]
    assert len(got_in) == len(prompt) - 3
    expected_in = [float(want[p - 1, prompt[p]]) for p in range(3, len(prompt))]
    assert torch.allclose(torch.tensor(got_in), torch.tensor(expected_in), atol=2e-3)
    expected_out = [float(want[len(prompt) + i - 1, t]) for i, t in enumerate(r.output_ids)]
    got_out = [e[0] for e in r.output_token_logprobs]
    assert torch.allclose(torch.tensor(got_out), torch.tensor(expected_out), atol=2e-3)
    top = r.output_top_logprobs[0]
    assert len(top) == 5 and top[0][1] == r.output_ids[0]  # greedy picks the top token


@pytest.mark.parametrize("ids,needle", [
    ([], "empty"),
    ([1] * 9000, "context length"),
    ([60000], "vocabulary"),
])
def test_bad_input_fails_the_request_not_the_scheduler(harness: Harness, ids: list[int],
                                                        needle: str) -> None:
    r = one(harness, ids, max_new_tokens=4)
    assert r.finish_reason["type"] == "abort" and needle in r.error
    ok = one(harness, harness.chat_ids("Hi"), max_new_tokens=2, temperature=0)
    assert len(ok.output_ids) == 2


def test_failing_forward_fails_its_requests_and_frees_their_memory(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake fault: a forward pass that raises cannot be caused with the real model otherwise.
    runner = harness.scheduler.runner
    real_forward = runner.forward
    calls = itertools.count()

    def forward_failing_once(batch: Any) -> Any:
        if next(calls) == 0:
            raise RuntimeError("injected fault")
        return real_forward(batch)

    monkeypatch.setattr(runner, "forward", forward_failing_once)
    prompt = harness.chat_ids("Name three colors.")
    failed = one(harness, prompt, max_new_tokens=4, temperature=0)
    assert failed.error is not None and "injected fault" in failed.error
    assert failed.finish_reason["type"] == "abort"
    harness.assert_memory_empty()
    after = one(harness, prompt, max_new_tokens=4, temperature=0)  # the scheduler goes on
    assert after.error is None and len(after.output_ids) == 4
    harness.assert_memory_empty()


def test_a_huge_max_new_tokens_does_not_starve_the_next_request(harness: Harness) -> None:
    """For a request asking for 2**31 new tokens admission reserves only what the context and
    the KV pool can hold; a short request behind it runs while it does (it used to wait until
    the first finished). The frontends refuse such a request with a 400; this is the
    scheduler's own defence, for callers that reach it directly."""
    prompt = harness.chat_ids("Tell me a story.")
    long = harness.submit(prompt, max_new_tokens=2**31, ignore_eos=True, temperature=0)
    short = harness.submit(prompt, max_new_tokens=2, temperature=0)
    s = harness.scheduler
    known = {r.rid for r in s.waiting}
    while not {long, short} <= known:  # both have arrived over the socket
        s.recv_requests(block=True)
        known = {r.rid for r in s.waiting}
    finished_short_at = None
    for step in range(30):
        s.step()
        if finished_short_at is None and not any(r.rid == short for r in [*s.running,
                                                                          *s.waiting]):
            finished_short_at = step
    assert finished_short_at is not None, "the short request still waits behind the long one"
    assert any(r.rid == long for r in s.running)  # it ran beside the long request
    results = harness.run([short, long], abort={long: 0})
    assert harness.scheduler.idle and results
    harness.assert_memory_empty()


def test_a_request_whose_logprobs_fail_fails_alone(harness: Harness) -> None:
    """More top logprobs than the vocabulary has makes ``topk`` raise for that request (the
    frontends refuse it with a 400; this request reaches the scheduler directly). It used to
    fail every request of its batch; now the others run on, token for token as alone."""
    prompts = [harness.chat_ids(q) for q in QUESTIONS[:3]]
    alone = [one(harness, p, max_new_tokens=6, temperature=0).output_ids for p in prompts]
    bad = LogprobOptions(return_logprob=True, top_logprobs_num=10**6)
    rids = [harness.submit(prompts[0], max_new_tokens=6, temperature=0),
            harness.submit(prompts[1], logprobs=bad, max_new_tokens=6, temperature=0),
            harness.submit(prompts[2], max_new_tokens=6, temperature=0)]
    results = harness.run(rids)
    failed = results[rids[1]]
    assert failed.finish_reason["type"] == "abort" and "internal error" in failed.error
    for rid, expected in zip([rids[0], rids[2]], [alone[0], alone[2]]):
        assert results[rid].error is None and results[rid].output_ids == expected
    harness.assert_memory_empty()


def test_a_forward_that_fails_for_one_request_fails_it_alone(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake fault: the real model has no input that makes its forward raise. It raises for any
    # batch holding the poison token, as a kernel would fail on one sequence's shape.
    runner = harness.scheduler.runner
    real_forward = runner.forward
    poison = 12345

    def forward(batch: Any) -> Any:
        if bool((batch.input_ids == poison).any()):
            raise RuntimeError("injected fault")
        return real_forward(batch)

    monkeypatch.setattr(runner, "forward", forward)
    prompts = [harness.chat_ids(q) for q in QUESTIONS[3:6]]
    assert all(poison not in p for p in prompts)
    alone = [one(harness, p, max_new_tokens=5, temperature=0).output_ids for p in prompts]
    rids = [harness.submit(prompts[0], max_new_tokens=5, temperature=0),
            harness.submit([*prompts[1], poison], max_new_tokens=5, temperature=0),
            harness.submit(prompts[2], max_new_tokens=5, temperature=0)]
    results = harness.run(rids)
    assert "injected fault" in (results[rids[1]].error or "")
    for rid, expected in zip([rids[0], rids[2]], [alone[0], alone[2]]):
        assert results[rid].error is None and results[rid].output_ids == expected
    harness.assert_memory_empty()


def test_open_sessions_are_bounded(harness: Harness) -> None:
    """Sessions used to have no limit: a client could open them until memory ran out."""
    from sgl.engine.sessions import MAX_OPEN_SESSIONS

    sessions, cache = harness.scheduler.sessions, harness.scheduler.cache
    opened = [f"bounded-{i}" for i in range(MAX_OPEN_SESSIONS - len(sessions))]
    try:
        assert all(sessions.open_session(sid)["success"] for sid in opened)
        refused = sessions.open_session("one-too-many")
        assert not refused["success"] and f"{MAX_OPEN_SESSIONS} sessions" in refused["message"]
        assert sessions.close_session(opened[0], cache)["success"]
        assert sessions.open_session("one-too-many")["success"]  # room again after a close
        opened[0] = "one-too-many"
    finally:
        for sid in opened:
            sessions.close_session(sid, cache)


def test_a_pool_smaller_than_the_output_says_why_it_stopped(tmp_path: Path) -> None:
    """With a KV pool of 64 tokens a longer generation stops at the pool's end; the finish
    reason used to say only "length", as if max_new_tokens had been reached."""
    h = Harness(tmp_path, max_total_tokens=64)
    try:
        with torch.inference_mode():
            r = one(h, h.chat_ids("Tell me a long story."), max_new_tokens=200, ignore_eos=True,
                    temperature=0)
        assert r.finish_reason["type"] == "length" and len(r.output_ids) < 200
        assert "KV pool (64 tokens" in r.finish_reason["message"]
    finally:
        h.close()


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_short_requests_keep_their_latency_beside_one_that_fills_the_context(
        tmp_path: Path, policy: str) -> None:
    """Fairness, counted in scheduler steps (one forward each, so the bound holds on any
    machine): while one request generates to the end of the context, short requests that
    arrive one after another each finish in as many steps as alone, give or take one."""
    h = Harness(tmp_path, context_length=256, schedule_policy=policy)
    s = h.scheduler
    try:
        with torch.inference_mode():
            prompts = [h.chat_ids(q) for q in QUESTIONS]

            def steps_to_finish(rid: str, limit: int = 100) -> int:
                for step in range(1, limit + 1):
                    s.recv_requests(block=False)
                    s.step()
                    while h.pull.poll(0):  # its outputs are not looked at: only when it ends
                        h.pull.recv_pyobj()
                    if not any(r.rid == rid for r in [*s.running, *s.waiting]) and step > 1:
                        return step
                raise AssertionError(f"{rid} did not finish in {limit} steps")

            def arrive(rid: str) -> None:
                while not any(r.rid == rid for r in [*s.running, *s.waiting]):
                    s.recv_requests(block=True)

            alone = []
            for prompt in prompts:
                rid = h.submit(prompt, max_new_tokens=8, ignore_eos=True, temperature=0)
                arrive(rid)
                alone.append(steps_to_finish(rid))
            long = h.submit(prompts[0], max_new_tokens=256 - len(prompts[0]), ignore_eos=True,
                            temperature=0)
            arrive(long)
            beside = []
            for prompt in prompts:
                rid = h.submit(prompt, max_new_tokens=8, ignore_eos=True, temperature=0)
                arrive(rid)
                beside.append(steps_to_finish(rid))
                assert any(r.rid == long for r in s.running), "the long request ran meanwhile"
            while h.pull.poll(200):  # the last short request's final output, still in flight
                h.pull.recv_pyobj()
            results = h.run([long])
        reason = results[long].finish_reason  # it filled the context
        assert reason["type"] == "length" and reason["length"] + len(prompts[0]) == 256
        assert all(b <= a + 1 for a, b in zip(alone, beside)), (alone, beside)
        h.assert_memory_empty()
    finally:
        h.close()


def test_a_dropped_scheduler_never_blocks_the_garbage_collector(tmp_path: Path) -> None:
    """The scheduler's sockets, with an output queued for a server that is gone, dropped without
    close() in a reference cycle (its handlers refer back to it). The collector, which runs in
    whatever thread allocates, finalized a context of its own before its sockets, and the
    context's term() then waited for them for ever: a CI run hung at exit on a thread pool
    worker that happened to collect one. It must return at once."""
    import gc

    from sgl.engine.scheduler_io import SchedulerIO

    io = SchedulerIO.__new__(SchedulerIO)
    io.connect({"requests": f"ipc://{tmp_path}/requests", "outputs": f"ipc://{tmp_path}/outputs"})
    io.send_sock.send_pyobj("an output no server takes")
    del io
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(10)
    assert not collector.is_alive(), "collecting a dropped scheduler's sockets hung"
