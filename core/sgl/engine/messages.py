"""The typed messages the server process and the scheduler process exchange over ZMQ.

Logprob entries use SGLang's layout: ``(logprob, token_id, None)``; the server fills in the
token text when ``return_text_in_logprobs`` is set. The first prompt position has no logprob
(``None``) because nothing predicts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.sampling import SamplingParams

__all__ = [
    "AbortRequest",
    "Bootstrap",
    "CloseSessionRequest",
    "FlushCacheRequest",
    "GenerateRequest",
    "LogprobOptions",
    "OpenSessionRequest",
    "SchedulerInfo",
    "ServerInfoRequest",
    "ShutdownRequest",
    "TokenBatch",
    "TokenOutput",
]

#: one logprob entry: (logprob or None, token id, text or None)
LogprobEntry = tuple[float | None, int, str | None]


@dataclass
class LogprobOptions:
    """What logprobs a request wants (SGLang's names)."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position to report; -1: output tokens only
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's other half runs (SGLang's bootstrap fields): the
    prefill server's ``host`` and bootstrap ``port`` (None: the decode server's
    ``--disaggregation-bootstrap-port``), and the ``room`` both servers know the request by."""

    host: str
    port: int | None
    room: int


@dataclass
class GenerateRequest:
    """Server -> scheduler: generate for one tokenized prompt."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    arrival_time: float = 0.0  # time.time() when the server received it
    session_id: str | None = None  # an open session whose conversation this request continues
    data_parallel_rank: int | None = None  # the replica to run on; None: the router picks
    bootstrap: Bootstrap | None = None  # prefill/decode disaggregation (SGLang's router sets it)


@dataclass
class AbortRequest:
    """Server -> scheduler: stop a request and free its memory."""

    rid: str


@dataclass
class FlushCacheRequest:
    """Server -> scheduler: drop cached prefixes (answered with a :class:`TokenBatch` ack)."""

    rid: str


@dataclass
class ServerInfoRequest:
    """Server -> scheduler: report load and memory (answered in :attr:`TokenBatch.info`)."""

    rid: str


@dataclass
class OpenSessionRequest:
    """Server -> scheduler: open a session (answered in :attr:`TokenBatch.info`)."""

    rid: str
    session_id: str


@dataclass
class CloseSessionRequest:
    """Server -> scheduler: close a session; its cached conversation may be evicted again."""

    rid: str
    session_id: str


@dataclass
class ShutdownRequest:
    """Server -> scheduler: exit cleanly."""


@dataclass
class TokenOutput:
    """What happened to one request since the previous message.

    ``new_token_ids`` and the logprob lists carry only the entries that are new; the server
    appends them.
    """

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None  # {"type": "stop"|"length"|"abort", ...}
    error: str | None = None  # set when the request failed; finish_reason is then "abort"
    error_status: int = 400  # HTTP status for the error: 400 bad request, 500 internal
    input_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    first_token_time: float | None = None  # scheduler's time.time() of the first output token
    queue_time: float | None = None  # seconds between arrival and first scheduling
    spec: dict[str, Any] | None = None  # speculative decoding counts (SGLang's meta_info keys)


@dataclass
class TokenBatch:
    """Scheduler -> server: the outputs of one scheduler step, or the answer to a request."""

    outputs: list[TokenOutput] = field(default_factory=list)
    info: dict[str, Any] | None = None  # answer to ServerInfoRequest / FlushCacheRequest
    info_rid: str | None = None


@dataclass
class SchedulerInfo:
    """Scheduler -> server once the model is loaded (or why it could not be)."""

    ok: bool
    error: str | None = None
    model_path: str = ""
    architecture: str = ""
    dtype: str = ""
    quantization: str = "none"  # the mode in use (ModelRunner.quantization)
    weights_bytes: int = 0  # the model's weights in memory (sgl.engine.model_runner.weights_bytes)
    num_threads: int = 0
    kernel_threads: int = 1
    cpu_isa: str = ""  # the CPU kernels' level and why (sgl.kernels.cpu.describe_isa)
    context_length: int = 0
    vocab_size: int = 0
    max_total_tokens: int = 0
    kv_pool_bytes: int = 0
    attention_backend: str = ""
    max_running_requests: int = 0
    chunked_prefill_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    cache_policy: str = "none"
    schedule_policy: str = "fcfs"
    grammar_backend: str = "none"  # the backend constrained requests use; "none": refused
    parallel: dict[str, Any] = field(default_factory=dict)  # the strategy and its sizes, if any
