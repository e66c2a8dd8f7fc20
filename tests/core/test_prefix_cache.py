"""The scheduler with the radix prefix cache (``sgl-cache-radix``) and the real SmolLM2:
outputs equal to those without a cache, cached_tokens, in-queue prefix sharing, schedule
policies, pages, and logprobs that never come from the cache."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch
from sgl_cache_radix.radix_cache import RadixCache
from test_scheduler import Harness, one  # same folder

from sgl.engine.messages import LogprobOptions
from sgl.kvcache import NoPrefixCache

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant. Answer in one short sentence, with no preamble, and "
          "say so when you do not know. ") * 4
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Who wrote Hamlet?",
             "What is 12 times 12?", "What is the boiling point of water?",
             "Explain gravity briefly.", "Name a large ocean.", "What do bees make?"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(tmp_path_factory.mktemp("cache"))
    assert isinstance(h.scheduler.cache, RadixCache), "radix is the default when installed"
    with torch.inference_mode():
        yield h
    h.close()


def use_cache(h: Harness, cache_cls: type, **kw: int) -> None:
    s = h.scheduler
    assert s.idle and s.flush_cache()["success"]
    s.cache = cache_cls(kv_pool=s.runner.kv_pool, **kw)


def shared_prompts(h: Harness) -> list[list[int]]:
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS]
    out = []
    for m in msgs:
        ids = h.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_all(h: Harness, prompts: list[list[int]], **params: object) -> list:
    rids = [h.submit(p, max_new_tokens=12, temperature=0, **params) for p in prompts]
    results = h.run(rids)
    return [results[r] for r in rids]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_outputs_with_cache_equal_outputs_without(harness: Harness, policy: str) -> None:
    prompts = shared_prompts(harness) * 2  # every prompt twice: exact repeats too
    settings = harness.scheduler.settings
    harness.scheduler.settings = dataclasses.replace(settings, schedule_policy=policy)
    try:
        use_cache(harness, NoPrefixCache)
        plain = run_all(harness, prompts)
        assert all(r.cached_tokens == 0 for r in plain)
        use_cache(harness, RadixCache)
        cached = run_all(harness, prompts)
    finally:
        harness.scheduler.settings = settings
    assert [r.output_ids for r in cached] == [r.output_ids for r in plain]
    hits = sum(r.cached_tokens for r in cached)
    shared = len(shared_prompts(harness)[0]) - 20
    if policy == "fcfs":  # no in-queue sharing: the first batch computes the prefix 5 times
        assert hits >= (len(prompts) - 6) * shared, [r.cached_tokens for r in cached]
    else:  # the shared system prompt was computed once, not once per request
        assert hits >= (len(prompts) - 1) * shared, (policy, [r.cached_tokens for r in cached])
    stats = harness.scheduler.cache.stats
    assert stats.hit_tokens == hits and 0 < stats.hit_rate < 1
    harness.assert_memory_empty()


@pytest.mark.parametrize("page_size", [1, 4])
def test_repeated_request_is_cached_but_one_page(harness: Harness, page_size: int) -> None:
    use_cache(harness, RadixCache, page_size=page_size)
    prompt = shared_prompts(harness)[0]
    first = one(harness, prompt, max_new_tokens=8, temperature=0)
    again = one(harness, prompt, max_new_tokens=8, temperature=0)
    assert first.cached_tokens == 0
    assert len(prompt) - page_size <= again.cached_tokens <= len(prompt) - 1
    assert again.output_ids == first.output_ids
    # a follow-up turn finds prompt + answer where decode steps attend as prefills do (sgl's
    # kernels); elsewhere the prompt only, so that it gets what it gets cold
    # (test_greedy_invariance)
    follow = prompt + first.output_ids + [prompt[-1]]
    turn = one(harness, follow, max_new_tokens=4, temperature=0)
    if harness.scheduler.runner.decode_matches_prefill:
        assert turn.cached_tokens >= len(prompt) + len(first.output_ids) - 1 - page_size
    else:
        assert len(prompt) - page_size <= turn.cached_tokens <= len(prompt)
    harness.assert_memory_empty()


def test_prompt_logprobs_are_computed_not_cached(harness: Harness) -> None:
    use_cache(harness, RadixCache)
    prompt = shared_prompts(harness)[1]
    first = one(harness, prompt, max_new_tokens=2, temperature=0)
    wants = LogprobOptions(True, 0, 0, None)
    again = one(harness, prompt, max_new_tokens=2, temperature=0, logprobs=wants)
    assert again.cached_tokens == 0  # position 0 onwards needs the hidden states
    assert len(again.input_token_logprobs) == len(prompt)
    late = one(harness, prompt, max_new_tokens=2, temperature=0,
               logprobs=LogprobOptions(True, len(prompt) - 5, 0, None))
    assert late.cached_tokens == len(prompt) - 6
    assert len(late.input_token_logprobs) == 5
    torch.testing.assert_close(torch.tensor([e[0] for e in late.input_token_logprobs]),
                               torch.tensor([e[0] for e in again.input_token_logprobs[-5:]]),
                               rtol=2e-4, atol=1e-4)
    assert first.output_ids == again.output_ids == late.output_ids
    harness.assert_memory_empty()


def test_eviction_under_memory_pressure_loses_nothing(harness: Harness) -> None:
    use_cache(harness, RadixCache)
    s = harness.scheduler
    prompts = [list(range(1000 + 300 * i, 1000 + 300 * i + 250)) for i in range(6)]
    # 6 distinct 250-token prompts do not fit in the 1200-slot pool together with the cache
    results = run_all(harness, prompts)
    assert s.cache.stats.evicted_tokens > 0
    alone = [one(harness, p, max_new_tokens=12, temperature=0) for p in prompts[:2]]
    assert [r.output_ids for r in results[:2]] == [r.output_ids for r in alone]
    harness.assert_memory_empty()


def test_session_keeps_its_conversation_through_eviction(harness: Harness) -> None:
    use_cache(harness, RadixCache)
    s = harness.scheduler
    assert s.sessions.open_session("chat")["success"]
    assert not s.sessions.open_session("chat")["success"]  # already open
    turn1 = shared_prompts(harness)[2]
    first = one(harness, turn1, max_new_tokens=6, temperature=0, session_id="chat")
    # other traffic fills the pool: everything unprotected is evicted before the session
    others = [list(range(2000 + 400 * i, 2000 + 400 * i + 300)) for i in range(4)]
    run_all(harness, others)
    assert s.cache.stats.evicted_tokens > 0
    turn2 = turn1 + first.output_ids + shared_prompts(harness)[3][-8:]
    second = one(harness, turn2, max_new_tokens=4, temperature=0, session_id="chat")
    assert second.cached_tokens >= len(turn1) + len(first.output_ids) - 1
    assert s.sessions.close_session("chat", s.cache)["success"]
    assert not s.sessions.close_session("chat", s.cache)["success"]
    unknown = one(harness, turn1, max_new_tokens=2, session_id="nope")
    assert unknown.error is not None and "not open" in unknown.error
    assert s.load_info()["num_sessions"] == 0
    harness.assert_memory_empty()


def test_identical_prompts_at_once_share_one_prefill(harness: Harness) -> None:
    """What ``n > 1`` sends the scheduler (the tokenizer manager expands it into requests with
    the same prompt): one computes the prompt, the others wait a step and take it from the
    cache."""
    use_cache(harness, RadixCache)
    assert harness.scheduler.settings.schedule_policy == "lpm"  # the default, cache-aware
    prompt = shared_prompts(harness)[4]
    rids = [harness.submit(prompt, max_new_tokens=6, temperature=0.8, seed=i) for i in range(4)]
    results = harness.run(rids)
    cached = sorted(results[r].cached_tokens for r in rids)
    assert cached == [0] + [len(prompt) - 1] * 3
    harness.assert_memory_empty()


def test_burst_waits_for_a_system_prompt_still_in_its_chunks(harness: Harness) -> None:
    """Requests that arrive while the first one on their system prompt is still in its prefill
    chunks wait for it (a step or two) and find the whole system prompt in the cache, instead
    of computing the part not yet cached once each (SGLang's in-batch prefix sharing, carried
    across steps)."""
    use_cache(harness, RadixCache)
    s = harness.scheduler
    prompts = shared_prompts(harness)
    shared = min(len(os.path.commonprefix([prompts[0], p])) for p in prompts[1:4])
    assert shared > 96
    chunk = s.chunk_size
    s.chunk_size = 100  # the first prompt takes two steps, and starts mid-step
    try:
        first = [harness.submit(harness.chat_ids("Hi"), max_new_tokens=4, temperature=0),
                 harness.submit(prompts[0], max_new_tokens=4, temperature=0)]
        s.recv_requests(block=False)
        s.step()  # the short prompt, then the first chunk of the long one
        burst = [harness.submit(p, max_new_tokens=4, temperature=0) for p in prompts[1:4]]
        results = harness.run(first + burst)
    finally:
        s.chunk_size = chunk
    cached = [results[r].cached_tokens for r in burst]
    assert all(n >= shared for n in cached), (shared, cached)
    harness.assert_memory_empty()
