"""When a request's output ends: stop tokens, stop strings and regexes, the length limits, and
the tokens that may not end it yet.

SGLang's rules, in its order: a stop token (the request's ``stop_token_ids``, or the model's EOS
unless ``ignore_eos``) once ``min_new_tokens`` are out; then a stop string or ``stop_regex``
found in the detokenized end of the output (so it may span tokens); then ``max_new_tokens``;
then the context length. A request whose grammar terminated is already finished. Before
``min_new_tokens``, EOS and stop tokens are banned from sampling unless a grammar decides where
the output ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sgl.engine.sequence import Req
from sgl.sampling import stop_regex

__all__ = ["STOP_REGEX_WINDOW", "FinishRules"]

#: output tokens a stop_regex is matched against (the end of the output)
STOP_REGEX_WINDOW = 32


class FinishRules:
    """The finishing rules of one model: its EOS ids, its context length, its tokenizer (a
    callable: loaded in the background, needed only for stop strings)."""

    def __init__(self, eos_token_ids: Sequence[int], context_length: int,
                 tokenizer: Callable[[], Any]) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.context_length = context_length
        self._tokenizer = tokenizer

    def banned(self, req: Req, output_len: int | None = None) -> list[int]:
        """EOS and stop tokens may not end the output before min_new_tokens (unless a grammar
        decides when the output ends); ``output_len``: the output's length at that token
        (default: now)."""
        n = len(req.output_ids) if output_len is None else output_len
        if n >= req.sampling.min_new_tokens or req.grammar is not None:
            return []
        return sorted(set(req.sampling.stop_token_ids) | set(self.eos_token_ids))

    def check(self, req: Req) -> None:
        """Set ``req.finish_reason`` if its last token ends it."""
        if req.finished:  # by its grammar
            return
        token, params = req.output_ids[-1], req.sampling
        if len(req.output_ids) >= params.min_new_tokens and (
                token in params.stop_token_ids
                or (not params.ignore_eos and token in self.eos_token_ids)):
            req.finish_reason = {"type": "stop", "matched": token}
        elif (params.stop or params.stop_regex) and \
                (matched := self.matched_stop_string(req)) is not None:
            req.finish_reason = {"type": "stop", "matched": matched}
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": params.max_new_tokens}
        elif req.seq_len >= self.context_length:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}

    def matched_stop_string(self, req: Req) -> str | None:
        """The stop string, or the text a stop regex matched, at the end of the output."""
        if len(req.output_ids) < req.sampling.min_new_tokens:
            return None
        window = max((len(s) for s in req.sampling.stop), default=0) + 4
        if req.sampling.stop_regex:
            window = max(window, STOP_REGEX_WINDOW)
        tail = self._tokenizer().decode(req.output_ids[-window:], skip_special_tokens=False)
        for stop in req.sampling.stop:
            if stop in tail:
                return stop
        for pattern in req.sampling.stop_regex:  # compiled once (RE2: linear time)
            if (found := stop_regex(pattern).search(tail)) and found.group(0):
                return found.group(0)
        return None
