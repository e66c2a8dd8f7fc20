"""sgl bench's results-file document and warm-up requests, without a server."""

from __future__ import annotations

import json

from sgl_bench.cli import RESULT_SCHEMA, result_document, warmup_request
from sgl_bench.datasets import BenchRequest
from sgl_bench.metrics import RequestResult, compute_metrics


def test_result_document_is_strict_json() -> None:
    trace = [RequestResult(success=True, start=0.0, end=1.0, prompt_len=4, output_len=2,
                           chunk_times=[0.5, 1.0])]
    metrics = compute_metrics(trace, duration=0.0)  # no duration: throughputs are NaN
    doc = result_document("serving", {"request_rate": float("inf"), "seed": 1}, metrics,
                          server={"backend": "sgl"})
    text = json.dumps(doc, allow_nan=False)  # would raise on inf/nan
    back = json.loads(text)
    assert back["schema"] == RESULT_SCHEMA == "sgl-bench/1"
    assert back["command"] == "serving"
    assert back["config"] == {"request_rate": "inf", "seed": 1}
    assert back["metrics"]["request_throughput"] is None
    assert back["metrics"]["ttft_ms"]["mean"] == 500.0
    assert set(back["environment"]) == {"python", "platform", "machine", "sgl"}
    assert back["server"] == {"backend": "sgl"}
    assert back["date"].endswith("+00:00")


def test_warmup_requests_share_no_prefix_with_the_run() -> None:
    ids = BenchRequest([5, 6, 7, 8], 4, 128)
    warm = warmup_request(ids)
    assert warm.prompt == [8, 7, 6, 5] and warm.output_len == 16
    text = BenchRequest("question?", 3, 8, system="You are a bot. ")
    warm = warmup_request(text)
    assert isinstance(warm.prompt, str) and not warm.prompt.startswith("You are")
    assert warm.prompt.endswith("You are a bot. question?") and warm.output_len == 8
    assert warm.system is None
