"""Speculative decoding with the NGRAM plugin in a real scheduler with the real SmolLM2
(float32), in-process: outputs equal those without speculation token for token (greedy, and
seeded sampling with penalties), in batches mixing drafted and undrafted requests, with chunked
prefill, the radix cache, retraction, abort, stop strings and tokens inside an accepted run,
logprobs, JSON-schema decoding; and nothing leaks from the KV pool."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "core"))
sys.path.insert(0, str(Path(__file__).parents[1] / "grammar"))
from _cases import PERSON, PERSON_PROMPT, check_json  # noqa: E402
from sgl_spec_ngram.ngram import ngram_draft, ngram_tree  # noqa: E402
from test_scheduler import Harness, Result, mixed_prompts  # noqa: E402

from sgl.engine.messages import LogprobOptions  # noqa: E402
from sgl.speculative import DraftTree  # noqa: E402

pytestmark = pytest.mark.slow

TEXT = ("The committee met on Tuesday to review the budget. It approved the new library, "
        "the repairs to the bridge and the summer festival, and it postponed the parking plan.")
COPY_TASKS = [
    f"Repeat this text exactly: {TEXT}",
    f"Copy the following sentence word for word: {TEXT}",
    "Write the numbers from 1 to 30, separated by commas.",
    'def add(a, b):\n    return a + b\n\nRewrite this Python function with type hints.',
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, Harness]]:
    """A scheduler without speculation and one with NGRAM (speculating at any batch size)."""
    plain = Harness(tmp_path_factory.mktemp("plain"))
    spec = Harness(tmp_path_factory.mktemp("spec"), speculative_algorithm="NGRAM",
                   speculative_disable_by_batch_size=64)
    with torch.inference_mode():
        yield plain, spec
    plain.close()
    spec.close()


def run_both(pair: tuple[Harness, Harness], prompts: list[list[int]],
             **params: Any) -> tuple[list[Result], list[Result]]:
    out = []
    for h in pair:
        rids = [h.submit(p, **params) for p in prompts]
        results = h.run(rids)
        out.append([results[r] for r in rids])
        h.assert_memory_empty()
    return out[0], out[1]


def test_ngram_draft_takes_the_longest_then_latest_match() -> None:
    assert ngram_draft([1, 2, 3, 4, 5, 1, 2, 3], 4) == [4, 5, 1, 2]
    # 1,2,3 matches at the start (3 tokens), 2,3 later (2 tokens): the longer match wins
    assert ngram_draft([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3], 3) == [9, 2, 3]
    # equal matches: the latest
    assert ngram_draft([4, 7, 1, 4, 8, 4], 1) == [8]
    assert ngram_draft([5, 6, 7], 3) == []
    assert ngram_draft([1, 2, 1], 0) == []
    assert ngram_draft([1, 2, 3, 1, 2, 3], 2, min_window=4) == []  # 3 < 4
    assert ngram_draft([3, 1, 2, 3, 1, 2], 2, max_window=1) == [3, 1]


def test_greedy_outputs_equal_without_speculation(pair: tuple[Harness, Harness]) -> None:
    plain, spec = pair
    prompts = [plain.chat_ids(t) for t in COPY_TASKS]
    stats = spec.scheduler.extensions.named("speculative").stats
    before = stats.accepted_drafts
    for batch in (prompts[:1], prompts, prompts + mixed_prompts(plain, 8)):
        a, b = run_both(pair, batch, max_new_tokens=48, temperature=0)
        for x, y in zip(a, b):
            assert y.output_ids == x.output_ids
            assert y.finish_reason == x.finish_reason
    assert stats.accepted_drafts > before + 20  # the drafts were used


def test_seeded_sampling_equals_without_speculation(pair: tuple[Harness, Harness]) -> None:
    """Draft tokens carry no probabilities, so verification samples the target at each row
    with the step's own seeded noise: the same tokens as without speculation."""
    plain, _ = pair
    prompts = [plain.chat_ids(t) for t in COPY_TASKS]
    for params in (dict(temperature=0.8, seed=11),
                   dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=3),
                   dict(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.3,
                        repetition_penalty=1.2, seed=5),
                   dict(temperature=0, min_new_tokens=30, logit_bias={"13": 2.0})):
        a, b = run_both(pair, prompts, max_new_tokens=40, **params)
        for x, y in zip(a, b):
            assert y.output_ids == x.output_ids, params


def test_chunked_prefill_and_retraction(pair: tuple[Harness, Harness]) -> None:
    plain, spec = pair
    prompts = mixed_prompts(plain, 40) + [plain.chat_ids(t) for t in COPY_TASKS]
    lengths = [8 + (i % 4) * 4 for i in range(len(prompts))]
    for chunk, count, retracts in ((512, len(prompts), True), (64, 12, False)):
        outs = []
        for h in pair:
            s = h.scheduler
            # admission expects 10% of max_new_tokens to be used: the small pool runs out
            s.chunk_size, s.new_token_ratio = chunk, 0.1
            before = s.num_retractions
            try:
                rids = [h.submit(p, max_new_tokens=n, temperature=0)
                        for p, n in zip(prompts[-count:], lengths[-count:])]
                results = h.run(rids)
            finally:
                s.chunk_size = 512
            if retracts and h is spec:
                assert s.num_retractions > before, "the small KV pool should force retraction"
            h.assert_memory_empty()
            outs.append([results[r] for r in rids])
        for x, y in zip(*outs):
            assert y.output_ids == x.output_ids


def test_stops_inside_an_accepted_run(pair: tuple[Harness, Harness]) -> None:
    """A stop string, a stop token or max_new_tokens falling inside a run of accepted draft
    tokens ends the output exactly where it ends without speculation."""
    plain, spec = pair
    prompt = plain.chat_ids(COPY_TASKS[0])
    free = run_both(pair, [prompt], max_new_tokens=40, temperature=0)[0][0]
    text_ids = free.output_ids
    stop_token = text_ids[12]
    stop_string = plain.tokenizer.decode(text_ids[15:17]).strip()
    for params in (dict(stop_token_ids=[stop_token]), dict(stop=[stop_string]),
                   dict(max_new_tokens=13), dict(max_new_tokens=1)):
        params = {"max_new_tokens": 40, **params}
        a, b = run_both(pair, [prompt], temperature=0, **params)
        assert b[0].output_ids == a[0].output_ids, params
        assert b[0].finish_reason == a[0].finish_reason, params
        assert len(b[0].output_ids) < 40


def test_logprobs_of_accepted_tokens(pair: tuple[Harness, Harness]) -> None:
    plain, _ = pair
    prompt = plain.chat_ids(COPY_TASKS[1])
    opts = LogprobOptions(True, -1, 3, [13, 42])
    a, b = run_both(pair, [prompt], max_new_tokens=32, temperature=0, logprobs=opts)
    assert b[0].output_ids == a[0].output_ids
    assert len(b[0].output_token_logprobs) == len(b[0].output_ids)
    assert [e[1] for e in b[0].output_token_logprobs] == b[0].output_ids
    got = torch.tensor([e[0] for e in b[0].output_token_logprobs])
    want = torch.tensor([e[0] for e in a[0].output_token_logprobs])
    # a verify row is an extend, a plain decode step the decode kernels: float32 rounding
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert [[t for _, t, _ in top] for top in b[0].output_top_logprobs] == \
        [[t for _, t, _ in top] for top in a[0].output_top_logprobs]


def test_json_schema_with_speculation(pair: tuple[Harness, Harness]) -> None:
    """The grammar masks every draft row (its matcher walks the draft, then rolls back):
    valid JSON, equal to the output without speculation, with draft tokens accepted."""
    plain, spec = pair
    prompt = plain.chat_ids(PERSON_PROMPT)
    for jump_forward in (True, False):
        for h in pair:
            h.scheduler.grammar.jump_forward = jump_forward
        before = spec.scheduler.extensions.named("speculative").stats.accepted_drafts
        a, b = run_both(pair, [prompt, prompt], max_new_tokens=160, temperature=0,
                        json_schema=json.dumps(PERSON))
        for x, y in zip(a, b):
            assert y.output_ids == x.output_ids
            check_json(plain.tokenizer.decode(y.output_ids, skip_special_tokens=True), PERSON)
        assert spec.scheduler.extensions.named("speculative").stats.accepted_drafts > before
    for h in pair:
        h.scheduler.grammar.jump_forward = True


def test_abort_while_speculating(pair: tuple[Harness, Harness]) -> None:
    _, spec = pair
    keep = spec.submit(spec.chat_ids(COPY_TASKS[0]), max_new_tokens=24, temperature=0)
    gone = spec.submit(spec.chat_ids(COPY_TASKS[2]), max_new_tokens=400, temperature=0,
                       ignore_eos=True)
    results = spec.run([keep, gone], abort={gone: 4})
    assert len(results[keep].output_ids) == 24 or results[keep].finish_reason["type"] == "stop"
    assert len(results[gone].output_ids) < 100  # stopped where the abort came
    spec.assert_memory_empty()


def test_per_request_and_server_counts(pair: tuple[Harness, Harness]) -> None:
    _, spec = pair
    s = spec.scheduler
    rid = spec.submit(spec.chat_ids(COPY_TASKS[0]), max_new_tokens=40, temperature=0)
    outputs = []
    for _ in range(400):
        s.recv_requests(block=False)
        s.step()
        outputs += [o for o in spec.receive() if o.rid == rid]
        if outputs and outputs[-1].finish_reason:
            break
    final = outputs[-1]
    assert final.spec is not None
    meta = final.spec
    assert meta["spec_verify_ct"] >= 1
    tokens = final.completion_tokens - 1  # the first token came from the prefill
    assert meta["spec_accept_length"] == pytest.approx(tokens / meta["spec_verify_ct"])
    assert meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
    info = s.load_info()
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["avg_spec_accept_length"] >= 1.0
    spec.assert_memory_empty()


def test_ngram_tree_merges_the_best_continuations() -> None:
    tree = ngram_tree([1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 7, 1, 2], 6, breadth=3)
    assert tree == DraftTree([7, 5, 3, 1, 6, 4], [-1, -1, -1, 0, 1, 2])
    # continuations that start alike are one branch: a chain
    assert ngram_tree([1, 2, 3, 4, 1, 2, 3, 9, 1, 2], 5, breadth=3) == [3, 9, 1, 2]
    assert ngram_tree([5, 6, 7], 3, breadth=2) == []


def test_draft_trees_give_the_same_outputs(pair: tuple[Harness, Harness]) -> None:
    """With --speculative-ngram-max-bfs-breadth 3 each request drafts a tree, verified in one
    forward under a tree mask; the target's branch is kept and its KV moved to the request's
    next positions."""
    plain, spec = pair
    drafter = spec.scheduler.extensions.named("speculative").algorithm
    trees = []
    propose = drafter.propose

    def recording(reqs):
        out = propose(reqs)
        trees.extend(d for d in out if isinstance(d, DraftTree))
        return out

    engine, paths = spec.scheduler.extensions.named("speculative"), []
    verify = engine.accept

    def recording_verify(*args):
        out = verify(*args)
        paths.extend(v.path for v in out if v.req.draft_parents is not None)
        return out

    prompts = [plain.chat_ids(t) for t in COPY_TASKS] + mixed_prompts(plain, 6)
    drafter.breadth, drafter.propose, engine.accept = 3, recording, recording_verify
    try:
        before = spec.scheduler.extensions.named("speculative").stats.accepted_drafts
        for params in (dict(temperature=0), dict(temperature=0.8, seed=4),
                       dict(temperature=0.7, frequency_penalty=0.5, seed=9)):
            a, b = run_both(pair, prompts, max_new_tokens=40, **params)
            for x, y in zip(a, b):
                assert y.output_ids == x.output_ids, params
        assert len(trees) > 10
        assert spec.scheduler.extensions.named("speculative").stats.accepted_drafts > before
        # some accepted branch was not the tree's first nodes: its KV was moved
        assert any(p != list(range(len(p))) for p in paths), paths
        # with a grammar a tree is cut to its first chain (the matcher walks one path)
        a, b = run_both(pair, [plain.chat_ids(PERSON_PROMPT)], max_new_tokens=120,
                        temperature=0, json_schema=json.dumps(PERSON))
        assert b[0].output_ids == a[0].output_ids
    finally:
        drafter.breadth, drafter.propose, engine.accept = 1, propose, verify


def test_malformed_drafts_are_dropped(pair: tuple[Harness, Harness]) -> None:
    """A drafter that proposes token ids outside the vocabulary, or a tree whose parents come
    after their children, costs its drafts (logged), never a request."""
    plain, spec = pair
    drafter = spec.scheduler.extensions.named("speculative").algorithm
    propose = drafter.propose
    bad = [[10**9], DraftTree([5, 6], [1, -1]), DraftTree([5], [])]

    def broken(reqs):
        return [bad[i % len(bad)] for i in range(len(reqs))]

    prompts = [plain.chat_ids(t) for t in COPY_TASKS]
    drafter.propose = broken
    try:
        a, b = run_both(pair, prompts, max_new_tokens=16, temperature=0)
    finally:
        drafter.propose = propose
    for x, y in zip(a, b):
        assert y.output_ids == x.output_ids and y.error is None
