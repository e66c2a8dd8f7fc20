"""sgl bench's metric arithmetic on a recorded trace: fixed timestamps, exact expected values."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sgl_bench.metrics import RequestResult, compute_metrics, percentile, summarize
from sgl_bench.serving import _progress, arrival_delays

# A recorded trace (seconds on one clock): two successful requests, one failed.
TRACE = [
    RequestResult(success=True, start=0.0, end=0.8, prompt_len=10, output_len=3,
                  chunk_times=[0.5, 0.6, 0.8]),
    RequestResult(success=True, start=0.2, end=1.6, prompt_len=20, output_len=2,
                  chunk_times=[1.2, 1.5]),
    RequestResult(success=False, start=0.3, end=0.4, prompt_len=5, output_len=0,
                  error="HTTP 500: boom"),
]


def test_per_request_values() -> None:
    a, b, failed = TRACE
    assert a.ttft == pytest.approx(0.5)
    assert a.itl == pytest.approx([0.1, 0.2])
    assert a.latency == pytest.approx(0.8)
    assert a.tpot == pytest.approx((0.8 - 0.5) / 2)
    assert b.ttft == pytest.approx(1.0)
    assert b.itl == pytest.approx([0.3])
    assert b.tpot == pytest.approx(0.4)
    assert failed.ttft is None and failed.tpot is None and failed.itl == []


def test_metrics_of_the_trace() -> None:
    m = compute_metrics(TRACE, duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["duration_s"] == 2.0
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 5)  # failed one left out
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["input_throughput"] == pytest.approx(15.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_throughput"] == pytest.approx(17.5)
    assert m["concurrency"] == pytest.approx((0.8 + 1.4) / 2.0)
    # milliseconds; p99 interpolates linearly between the two nearest ranks
    assert m["ttft_ms"]["mean"] == pytest.approx(750.0)
    assert m["ttft_ms"]["median"] == pytest.approx(750.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(995.0)
    assert m["itl_ms"]["mean"] == pytest.approx(200.0)
    assert m["itl_ms"]["median"] == pytest.approx(200.0)
    assert m["itl_ms"]["p99"] == pytest.approx(298.0)
    assert m["itl_ms"]["max"] == pytest.approx(300.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(275.0)
    assert m["tpot_ms"]["median"] == pytest.approx(275.0)
    assert m["tpot_ms"]["p99"] == pytest.approx(397.5)
    assert m["e2e_latency_ms"]["mean"] == pytest.approx(1100.0)
    assert m["e2e_latency_ms"]["median"] == pytest.approx(1100.0)
    assert m["e2e_latency_ms"]["p99"] == pytest.approx(1394.0)


def test_no_successful_request_gives_empty_statistics() -> None:
    m = compute_metrics(TRACE[2:], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["ttft_ms"] == {"mean": None, "median": None, "p99": None, "std": None, "max": None}
    assert m["request_throughput"] == 0.0


def test_one_token_requests_have_no_tpot() -> None:
    r = RequestResult(success=True, start=0.0, end=0.3, prompt_len=4, output_len=1,
                      chunk_times=[0.3])
    m = compute_metrics([r], duration=0.3)
    assert m["tpot_ms"]["mean"] is None and m["itl_ms"]["mean"] is None
    assert m["ttft_ms"]["mean"] == pytest.approx(300.0)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(3)
    for n in (1, 2, 5, 17, 100):
        xs = [rng.uniform(0, 10) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert summarize([1.0, 3.0], scale=1.0)["median"] == 2.0


def test_arrival_delays() -> None:
    assert arrival_delays(4, float("inf"), seed=0) == [0.0] * 4
    gaps = arrival_delays(4000, 8.0, seed=1)
    assert gaps == arrival_delays(4000, 8.0, seed=1)  # seeded
    assert gaps != arrival_delays(4000, 8.0, seed=2)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.05)  # Poisson: mean 1/rate


def test_stream_events_are_counted_per_backend() -> None:
    # native: cumulative completion_tokens
    assert _progress("sgl", {"text": " Paris", "meta_info": {"prompt_tokens": 5,
                                                             "completion_tokens": 1}}, None) \
        == (True, 5, 1)
    assert _progress("sgl", {"text": " Paris", "meta_info": {"completion_tokens": 1}}, 1)[0] \
        is False
    # OpenAI: content deltas, usage in the last chunk
    chat = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    assert _progress("openai-chat", chat, None) == (True, None, None)
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    assert _progress("openai-chat", usage, None) == (False, 9, 4)
    assert _progress("openai-completions", {"choices": [{"text": ""}]}, None)[0] is False
    assert _progress("openai-completions", {"choices": [{"text": "a"}]}, None)[0] is True
