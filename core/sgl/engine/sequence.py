"""A request as the scheduler tracks it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sgl.engine.messages import Bootstrap, LogprobEntry, LogprobOptions, TokenOutput
from sgl.kvcache import PrefixMatch
from sgl.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from sgl.grammar import BaseGrammarMatcher

__all__ = ["Req"]


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    seed: int = 0
    arrival_time: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None  # row in req_to_token while the request holds KV memory
    kv_len: int = 0  # tokens of input_ids + output_ids whose K/V are in the pool
    prefix: PrefixMatch = field(default_factory=PrefixMatch)  # leading slots owned by the cache
    cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    session_id: str | None = None
    bootstrap: Bootstrap | None = None  # the peer of a disaggregated request
    #: its KV past ``prefix`` came from an unauthenticated peer: freed at the end, never cached
    private_kv: bool = False
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    error_status: int = 400
    sent: int = 0  # output tokens already sent to the server
    scheduled_time: float | None = None
    first_token_time: float | None = None
    next_input_logprob: int = 0  # next prompt position whose logprob is still to be computed
    grammar: BaseGrammarMatcher | None = None  # the matcher of a constrained request
    # speculative decoding (sgl.engine.speculative): this step's draft (None: not speculating),
    # the KV slots its tokens took in the forward, and the request's counts
    draft: list[int] | None = None
    draft_parents: list[int] | None = None  # a draft tree (see sgl.speculative.DraftTree)
    draft_slots: torch.Tensor | None = None
    spec_verify_ct: int = 0
    spec_tokens: int = 0  # tokens its verifications produced
    spec_proposed: int = 0
    spec_accepted: int = 0
    # logprob entries computed but not yet sent
    input_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    input_token_ids_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    output_token_ids_logprobs: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        start = self.logprobs.logprob_start_len
        self.next_input_logprob = len(self.input_ids) if start < 0 else min(start, len(self.input_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens of the sequence whose K/V are not in the pool yet (1 for a decode)."""
        return self.seq_len - self.kv_len

    def token_slice(self, start: int, stop: int) -> list[int]:
        n_in = len(self.input_ids)
        return (self.input_ids[start:min(stop, n_in)]
                + self.output_ids[max(start - n_in, 0):max(stop - n_in, 0)])

    def remaining_new_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - len(self.output_ids), 0)

    def unsent(self) -> list[int]:
        new = self.output_ids[self.sent:]
        self.sent = len(self.output_ids)
        return new

    def take_output(self) -> TokenOutput:
        """What is new since the last output (tokens not sent, logprob entries), as a
        :class:`~sgl.engine.messages.TokenOutput`; the logprob lists go with it, emptied here."""
        out = TokenOutput(
            rid=self.rid, new_token_ids=self.unsent(), prompt_tokens=len(self.input_ids),
            cached_tokens=self.cached_tokens or 0, completion_tokens=len(self.output_ids),
            finish_reason=self.finish_reason, error=self.error, error_status=self.error_status,
            input_token_logprobs=self.input_token_logprobs,
            output_token_logprobs=self.output_token_logprobs,
            input_top_logprobs=self.input_top_logprobs,
            output_top_logprobs=self.output_top_logprobs,
            input_token_ids_logprobs=self.input_token_ids_logprobs,
            output_token_ids_logprobs=self.output_token_ids_logprobs,
            first_token_time=self.first_token_time, spec=self.spec_info(),
            queue_time=(self.scheduled_time - self.arrival_time) if self.scheduled_time
            else None)
        self.input_token_logprobs, self.output_token_logprobs = [], []
        self.input_top_logprobs, self.output_top_logprobs = [], []
        self.input_token_ids_logprobs, self.output_token_ids_logprobs = [], []
        return out

    def spec_info(self) -> dict[str, Any] | None:
        """SGLang's per-request ``meta_info`` keys of speculative decoding (None: it ran
        without)."""
        if not self.spec_verify_ct:
            return None
        return {"spec_verify_ct": self.spec_verify_ct,
                "spec_accept_length": self.spec_tokens / self.spec_verify_ct,
                "spec_accept_rate": self.spec_accepted / self.spec_proposed
                if self.spec_proposed else 0.0,
                "spec_num_proposed_drafts": self.spec_proposed,
                "spec_num_correct_drafts": self.spec_accepted}
