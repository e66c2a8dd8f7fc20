"""The typed messages the server process and the scheduler process exchange over ZMQ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.sampling import SamplingParams

__all__ = [
    "AbortRequest",
    "GenerateRequest",
    "SchedulerInfo",
    "ShutdownRequest",
    "TokenBatch",
    "TokenOutput",
]


@dataclass
class GenerateRequest:
    """Server -> scheduler: generate for one tokenized prompt."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass
class AbortRequest:
    """Server -> scheduler: stop a request and free its memory."""

    rid: str


@dataclass
class ShutdownRequest:
    """Server -> scheduler: exit cleanly."""


@dataclass
class TokenOutput:
    """New tokens of one request since the previous message, and whether it finished."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None = None  # SGLang shape: {"type": "stop"|"length"|"abort", ...}
    error: str | None = None  # set when the request failed; finish_reason is then "abort"
    error_status: int = 400  # HTTP status for the error: 400 bad request, 500 internal"


@dataclass
class TokenBatch:
    """Scheduler -> server: the outputs of one scheduler step."""

    outputs: list[TokenOutput] = field(default_factory=list)


@dataclass
class SchedulerInfo:
    """Scheduler -> server once the model is loaded (or why it could not be)."""

    ok: bool
    error: str | None = None
    model_path: str = ""
    architecture: str = ""
    dtype: str = ""
    num_threads: int = 0
    context_length: int = 0
    vocab_size: int = 0
    max_total_tokens: int = 0
    kv_pool_bytes: int = 0
    attention_backend: str = ""
    eos_token_ids: list[int] = field(default_factory=list)
