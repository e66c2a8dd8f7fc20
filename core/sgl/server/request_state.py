"""The server's view of one request in flight, and the SGLang-shaped dicts built from it.

The TokenizerManager's receive loop calls :meth:`ReqState.apply` with each
:class:`~sgl.engine.messages.TokenOutput`; the caller's side turns the state into stream chunks
(:meth:`ReqState.chunk`, only what is new) or the final result (:meth:`ReqState.result`).

A result has SGLang's ``/generate`` shape::

    {"text": str, "output_ids": [int, ...],
     "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                   "e2e_latency", "queue_time", "time_to_first_token",
                   # with speculative decoding: "spec_verify_ct", "spec_accept_length",
                   # "spec_accept_rate", "spec_num_proposed_drafts", "spec_num_correct_drafts"
                   # with return_logprob:
                   "input_token_logprobs", "output_token_logprobs",
                   "output_token_logprobs_length",
                   # with top_logprobs_num > 0:
                   "input_top_logprobs", "output_top_logprobs",
                   # with token_ids_logprob:
                   "input_token_ids_logprobs", "output_token_ids_logprobs"}}
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sgl.server.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from sgl.engine.messages import LogprobEntry, TokenOutput
    from sgl.server.io_struct import OneRequest

__all__ = ["LOGPROB_KEYS", "ReqState"]

#: the logprob lists of a TokenOutput, as named in meta_info
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")


class ReqState:
    """Everything received so far for one request, plus how much of it the caller has seen."""

    def __init__(self, req: OneRequest, input_ids: list[int], tokenizer: Any,
                 waker: asyncio.Event, token_text: Callable[[int], str],
                 arrival_time: float | None = None) -> None:
        self.req = req
        self.rid = req.rid
        self.waker = waker
        self._token_text = token_text
        params = req.sampling
        self.detok = IncrementalDetokenizer(
            tokenizer, input_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        # a stop string may still be completing at the end of the text: hold that much back
        self.holdback = max((len(s) for s in params.stop), default=1) - 1 \
            if params.stop and not params.no_stop_trim else 0
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.text = ""
        self.final_text: str | None = None
        self.output_ids: list[int] = []
        self.prompt_tokens = len(input_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.spec: dict[str, Any] | None = None  # speculative decoding counts
        self.finish_reason: dict[str, Any] | None = None
        self.error: str | None = None
        self.status = 400
        self.first_token_time: float | None = None
        self.queue_time: float | None = None
        self.finished_time: float | None = None
        self.logprobs: dict[str, list[Any]] = {key: [] for key in LOGPROB_KEYS}
        self._sent_text = 0
        self._sent_ids = 0
        self._sent_logprobs = dict.fromkeys(LOGPROB_KEYS, 0)
        self._sent_final = False
        self.dirty = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    # --- receiving ----------------------------------------------------------------------------

    def apply(self, out: TokenOutput) -> None:
        """Take in one message from the scheduler (only new ids and logprob entries)."""
        if self.finished:  # aborted here meanwhile
            return
        now = time.time()
        ids = [int(t) for t in out.new_token_ids]
        self.output_ids.extend(ids)
        if ids and self.first_token_time is None:
            self.first_token_time = out.first_token_time or now
        if out.queue_time is not None:
            self.queue_time = out.queue_time
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.spec = out.spec or self.spec
        self._add_logprobs(out)
        reason = out.finish_reason
        text_ids = ids
        if (reason is not None and reason.get("type") == "stop" and ids
                and not self.req.sampling.no_stop_trim
                and _is_token(reason.get("matched")) and ids[-1] == reason["matched"]):
            text_ids = ids[:-1]  # the stop token's own text is left out, as SGLang does
        before = len(self.text)
        self.text += self.detok.push(text_ids)
        if out.error is not None:
            self.error, self.status = out.error, out.error_status
        if reason is not None or out.error is not None:
            self.text += self.detok.flush()
            self.finish_reason = reason or {"type": "abort", "message": out.error}
            self.finished_time = now
            self.final_text = self._trim_stop(before)
        self.dirty = True
        self.waker.set()

    def abort(self, message: str) -> None:
        """End the request here, keeping what was generated (``/abort_request``)."""
        self.text += self.detok.flush()
        self.final_text = self.text
        self.finish_reason = {"type": "abort", "message": message}
        self.finished_time = time.time()
        self.dirty = True
        self.waker.set()

    def fail(self, message: str, status: int) -> None:
        self.error, self.status = message, status
        self.dirty = True
        self.waker.set()

    def _add_logprobs(self, out: TokenOutput) -> None:
        want_text = self.req.return_text_in_logprobs
        for key in LOGPROB_KEYS:
            entries = getattr(out, key, None)
            if not entries:
                continue
            if key.endswith("token_logprobs"):
                values = [self._entry(e, want_text) for e in entries]
            else:  # one list (or None) per position
                values = [None if pos is None else [self._entry(e, want_text) for e in pos]
                          for pos in entries]
            self.logprobs[key].extend(values)

    def _entry(self, entry: LogprobEntry, want_text: bool) -> tuple[Any, ...]:
        logprob, token_id, text = entry
        if want_text and text is None:
            text = self._token_text(int(token_id))
        return (logprob, int(token_id), text)

    def _trim_stop(self, before: int) -> str:
        """The text without the stop string that ended it (unless ``no_stop_trim``)."""
        reason = self.finish_reason or {}
        matched = reason.get("matched")
        if reason.get("type") != "stop" or not isinstance(matched, str) or not matched \
                or self.req.sampling.no_stop_trim:
            return self.text
        # the scheduler stops at the first occurrence, which ends in the newest tokens
        pos = self.text.find(matched, max(0, before - len(matched) + 1))
        if pos < 0:
            pos = self.text.find(matched)
        return self.text[:pos] if pos >= 0 else self.text

    # --- building outputs ---------------------------------------------------------------------

    def _meta(self, logprob_slices: dict[str, list[Any]]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            **(self.spec or {}),
        }
        opts = self.req.logprobs
        if opts.return_logprob:  # each kind asked for, prompt and output
            kinds = [kind for kind, wanted in (("token_logprobs", True),
                                               ("top_logprobs", opts.top_logprobs_num > 0),
                                               ("token_ids_logprobs", bool(opts.token_ids_logprob)))
                     if wanted]
            meta.update({key: logprob_slices[key] for kind in kinds
                         for key in (f"input_{kind}", f"output_{kind}")})
            # all output entries so far: a stream chunk holds only the new ones (SGLang's key)
            meta["output_token_logprobs_length"] = len(self.logprobs["output_token_logprobs"])
        if self.finished_time is not None:
            meta["e2e_latency"] = self.finished_time - self.arrival_time
            meta["queue_time"] = self.queue_time
            meta["time_to_first_token"] = (self.first_token_time - self.arrival_time
                                           if self.first_token_time is not None else None)
        return meta

    def result(self) -> dict[str, Any]:
        """The whole finished request."""
        text = self.final_text if self.final_text is not None else self.text
        return {"text": text, "output_ids": list(self.output_ids),
                "meta_info": self._meta({k: list(v) for k, v in self.logprobs.items()})}

    def chunk(self, cumulative: bool = False) -> dict[str, Any] | None:
        """What is new since the previous chunk, or None when there is nothing to tell.

        With ``cumulative`` the chunk holds the text and ids so far instead, the shape SGLang's
        ``/generate`` streams by default; logprob entries are always only the new ones."""
        self.dirty = False
        if self._sent_final:
            return None
        finished = self.finish_reason is not None
        if finished:
            text = self.final_text if self.final_text is not None else self.text
            end = len(text)
        else:
            text = self.text
            end = max(self._sent_text, len(text) - self.holdback)
        new_text = text[self._sent_text:end] if end > self._sent_text else ""
        new_ids = self.output_ids[self._sent_ids:]
        if not new_text and not new_ids and not finished:
            return None
        if cumulative:
            new_text, new_ids = text[:max(self._sent_text, end)], list(self.output_ids)
        slices = {k: v[self._sent_logprobs[k]:] for k, v in self.logprobs.items()}
        self._sent_text = max(self._sent_text, end)
        self._sent_ids = len(self.output_ids)
        self._sent_logprobs = {k: len(v) for k, v in self.logprobs.items()}
        self._sent_final = finished
        return {"text": new_text, "output_ids": new_ids, "meta_info": self._meta(slices)}


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
