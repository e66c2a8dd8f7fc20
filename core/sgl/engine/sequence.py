"""A request as the scheduler tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.sampling import SamplingParams

__all__ = ["Req"]


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None  # row in req_to_token while the request holds KV memory
    kv_len: int = 0  # tokens whose K/V are in the pool
    reserved: int = 0  # KV slots reserved for this request at admission
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    error_status: int = 400
    sent: int = 0  # output tokens already sent to the server

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def unsent(self) -> list[int]:
        new = self.output_ids[self.sent:]
        self.sent = len(self.output_ids)
        return new
