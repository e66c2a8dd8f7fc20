"""Prometheus metrics of one server (``GET /metrics``), in SGLang's names with an ``sgl:``
prefix.

Counters and histograms are fed by the TokenizerManager once per finished request
(:meth:`ServerMetrics.request_finished`); the gauges are read from the scheduler's load report
when ``/metrics`` is scraped (:meth:`ServerMetrics.set_load`). Each server (and each
:class:`sgl.Engine`) has its own registry, so several can live in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from sgl.server.request_state import ReqState

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 60.0, 120.0, 300.0)
_TOKEN_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                          0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """The metric objects of one server, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("sgl:num_requests", "Requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("sgl:prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("sgl:generation_tokens",
                                         "Tokens generated for finished requests.", registry=r)
        self.cached_tokens = Counter("sgl:cached_tokens",
                                     "Prompt tokens served from the prefix cache.", registry=r)
        self.ttft = Histogram("sgl:time_to_first_token_seconds",
                              "Seconds from receipt to the first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("sgl:inter_token_latency_seconds",
                                     "Mean seconds between output tokens, one sample per request.",
                                     buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sgl:e2e_request_latency_seconds",
                             "Seconds from receipt to the end of the request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_accept_length = Histogram(
            "sgl:spec_accept_length", "Tokens per speculative verification step, one sample per "
            "finished request that ran with speculative decoding.",
            buckets=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0), registry=r)
        self.timeouts = Counter("sgl:num_request_timeouts", "Requests aborted by "
                                "--request-timeout.", registry=r)
        self.running = Gauge("sgl:num_running_reqs", "Requests running in the scheduler.",
                             registry=r)
        self.queued = Gauge("sgl:num_queue_reqs", "Requests waiting to be scheduled.", registry=r)
        self.token_usage = Gauge("sgl:token_usage", "Fraction of the KV pool in use.", registry=r)
        self.kv_used = Gauge("sgl:kv_used_tokens", "KV pool slots in use.", registry=r)
        self.cache_hit_rate = Gauge("sgl:cache_hit_rate",
                                    "Fraction of prompt tokens found in the prefix cache.",
                                    registry=r)
        #: prefill/decode disaggregation (--disaggregation-mode), from the scheduler's report
        self.bootstrap_queue = Gauge("sgl:num_bootstrap_reqs", "Decode server: requests "
                                     "waiting for KV memory before their transfer.", registry=r)
        self.transfer_queue = Gauge("sgl:num_transfer_reqs", "Requests whose KV is being "
                                    "transferred (prefill: handed over; decode: awaited).",
                                    registry=r)
        self.kv_transfers = Gauge("sgl:kv_transfers", "KV transfers completed, ever.",
                                  registry=r)
        self.kv_transfer_failures = Gauge("sgl:kv_transfer_failures", "KV transfers failed or "
                                          "timed out, ever.", registry=r)
        self.kv_transfer_bytes = Gauge("sgl:kv_transfer_bytes", "Bytes of KV transferred, ever.",
                                       registry=r)
        #: per data-parallel replica (--dp-size above 1); the gauges above add them up
        self.replica_running = Gauge("sgl:replica_num_running_reqs",
                                     "Requests running in one data-parallel replica.",
                                     ["dp_rank"], registry=r)
        self.replica_queued = Gauge("sgl:replica_num_queue_reqs",
                                    "Requests waiting in one data-parallel replica.",
                                    ["dp_rank"], registry=r)
        self.replica_token_usage = Gauge("sgl:replica_token_usage",
                                         "Fraction of one data-parallel replica's KV pool in use.",
                                         ["dp_rank"], registry=r)
        self.replica_received = Gauge("sgl:replica_num_received_reqs",
                                      "Requests one data-parallel replica was sent, ever.",
                                      ["dp_rank"], registry=r)

    def request_finished(self, state: ReqState, now: float) -> None:
        """Count one request that finished, failed or was aborted."""
        reason = "error" if state.error is not None else \
            str((state.finish_reason or {}).get("type", "abort"))
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        self.cached_tokens.inc(state.cached_tokens)
        if state.spec and state.spec.get("spec_accept_length") is not None:
            self.spec_accept_length.observe(state.spec["spec_accept_length"])
        end = state.finished_time or now
        self.e2e.observe(max(0.0, end - state.arrival_time))
        if state.first_token_time is not None:
            self.ttft.observe(max(0.0, state.first_token_time - state.arrival_time))
            if state.completion_tokens > 1:
                self.inter_token.observe(max(0.0, end - state.first_token_time)
                                         / (state.completion_tokens - 1))

    def request_timed_out(self) -> None:
        self.timeouts.inc()

    def set_load(self, load: dict[str, Any]) -> None:
        """Set the gauges from the scheduler's load report (``ServerInfoRequest``)."""
        self.running.set(load.get("num_running_reqs", 0))
        self.queued.set(load.get("num_waiting_reqs", load.get("num_queue_reqs", 0)))
        used, total = load.get("kv_used_tokens", 0), load.get("kv_total_tokens", 0)
        self.kv_used.set(used)
        self.token_usage.set(used / total if total else 0.0)
        self.cache_hit_rate.set(load.get("cache_hit_rate") or 0.0)
        if "disaggregation_mode" in load:
            self.bootstrap_queue.set(load.get("num_bootstrap_reqs", 0))
            self.transfer_queue.set(load.get("num_transfer_reqs", 0))
            self.kv_transfers.set(load.get("kv_transfers", 0))
            self.kv_transfer_failures.set(load.get("kv_transfer_failures", 0))
            self.kv_transfer_bytes.set(load.get("kv_transfer_bytes", 0))

    def set_replica_loads(self, loads: list[dict[str, Any]]) -> None:
        """The per-replica gauges, from each replica's load report (several replicas only)."""
        if len(loads) < 2:
            return
        for rank, load in enumerate(loads):
            label = str(rank)
            self.replica_running.labels(dp_rank=label).set(load.get("num_running_reqs", 0))
            self.replica_queued.labels(dp_rank=label).set(load.get("num_waiting_reqs", 0))
            total = load.get("kv_total_tokens", 0)
            self.replica_token_usage.labels(dp_rank=label).set(
                load.get("kv_used_tokens", 0) / total if total else 0.0)
            self.replica_received.labels(dp_rank=label).set(load.get("num_received_reqs", 0))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
