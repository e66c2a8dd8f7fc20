"""Serving metrics from per-request timestamps: pure arithmetic, no I/O.

Definitions (times in seconds here, milliseconds in the report and the results file):

* **TTFT** of a request: from sending it to the arrival of the first chunk with output.
* **ITL**: the gaps between consecutive chunks with output of one request, pooled over all
  requests (one sample per gap; a chunk that carries several tokens counts once).
* **TPOT** of a request with ``n > 1`` output tokens: ``(latency - ttft) / (n - 1)``.
* **E2E latency** of a request: from sending it to the end of its response.
* **duration**: from the start of the benchmark (the first request sent) to the end of the
  last response; throughputs are totals over it; **concurrency** is the sum of the successful
  requests' latencies over it (the mean number of requests in flight).

Percentiles interpolate linearly between the two nearest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RequestResult", "compute_metrics", "percentile", "summarize"]


@dataclass
class RequestResult:
    """What one request did. Times are seconds of one clock (``time.perf_counter``).

    :param start: when the request was sent.
    :param chunk_times: arrival of each response chunk that carried output.
    :param end: when the response ended.
    :param prompt_len: prompt tokens (the server's count when it reported one).
    :param output_len: output tokens (the server's count when it reported one).
    """

    success: bool
    start: float
    end: float
    prompt_len: int
    output_len: int
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_len < 2:
            return None
        return (self.latency - ttft) / (self.output_len - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100), interpolated linearly between closest ranks (numpy's
    default, as SGLang's bench_serving computes it); NaN for no values."""
    return float(np.percentile(values, p)) if len(values) else math.nan


def summarize(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, median, p99 (and std, max) of ``values`` times ``scale`` (seconds to ms);
    None for each when there are no values."""
    if not values:
        return {"mean": None, "median": None, "p99": None, "std": None, "max": None}
    xs = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(xs.mean()), "median": float(np.median(xs)),
            "p99": float(np.percentile(xs, 99)), "std": float(xs.std()), "max": float(xs.max())}


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """The benchmark's metrics (the ``metrics`` object of the results file).

    :param results: every request of the run, failed ones included (counted, not measured).
    :param duration: seconds from the first request sent to the last response.
    """
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(total_in),
        "output_throughput": per_s(total_out),
        "total_throughput": per_s(total_in + total_out),
        "concurrency": per_s(sum(r.latency for r in ok)),
        "ttft_ms": summarize([t for r in ok if (t := r.ttft) is not None]),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": summarize([gap for r in ok for gap in r.itl]),
        "e2e_latency_ms": summarize([r.latency for r in ok]),
    }
