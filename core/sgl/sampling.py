"""Sampling parameters of a request.

Names and meanings follow SGLang's ``sampling_params`` so that clients move over unchanged.
The batched sampler that applies them lives in :mod:`sgl.engine.sampler`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

import re2

#: the constraint fields, as SGLang names them (the same names as sgl.grammar.CONSTRAINT_KINDS)
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "MAX_STOP_CHARS", "MAX_STOP_REGEXES", "MAX_STOP_STRINGS",
           "SamplingParams", "SamplingParamsError", "stop_regex"]

#: stop strings a request may give, and the characters of each: every one is looked for after
#: every token, in a decoded window as long as the longest
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
#: stop regexes a request may give (each at most MAX_STOP_CHARS long), matched with RE2 after
#: every token
MAX_STOP_REGEXES = 16
#: memory one compiled stop regex may take (RE2 refuses a pattern whose automaton is larger)
STOP_REGEX_MAX_MEM = 1 << 20


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown, of the wrong type or out of range; the message names it."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: the parameters that are real numbers
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty")
#: new tokens a request gets when it does not say (SGLang's default)
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)  # stop where the output matches one
    stop_token_ids: list[int] = field(default_factory=list)
    no_stop_trim: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # constrained decoding (at most one; see docs/grammar.md)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Validate a JSON ``sampling_params`` object; raise :class:`SamplingParamsError`."""
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise SamplingParamsError(f"sampling_params must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; supported: "
                f"{', '.join(sorted(known))}")
        values = {k: v for k, v in data.items() if v is not None}
        for name in ("stop", "stop_regex"):
            if isinstance(values.get(name), str):
                values[name] = [values[name]]
        if isinstance(values.get("logit_bias"), dict):
            try:
                values["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()}
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias keys must be token ids (integers)") from None
        for name in ("json_schema", "structural_tag"):  # SGLang takes JSON text; allow objects
            if isinstance(values.get(name), dict):
                values[name] = json.dumps(values[name])
        params = cls(**values)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`SamplingParamsError` naming the first bad parameter; then make the
        number parameters floats (a JSON ``1e30`` written as an integer does not fit a
        tensor's int64)."""
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SamplingParamsError(f"{name} must be {what}, got {getattr(self, name)!r}")

        need(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
             "max_new_tokens", "an integer >= 0")
        need(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens,
             "min_new_tokens", "an integer >= 0")
        need(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
             f"at most max_new_tokens ({self.max_new_tokens})")
        need(_is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        need(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
             "top_k", "-1 (off) or an integer >= 1")
        need(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        need(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty", "a number > 0")
        need(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty", "a number in [-2, 2]")
        need(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "presence_penalty", "a number in [-2, 2]")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop", "a string or a list of non-empty strings")
        need(len(self.stop) <= MAX_STOP_STRINGS
             and all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        need(isinstance(self.stop_regex, list) and len(self.stop_regex) <= MAX_STOP_REGEXES
             and all(_is_regex(r) for r in self.stop_regex), "stop_regex",
             f"a regular expression in RE2's syntax (Python's without backreferences or "
             f"lookaround, matched in linear time; at most {MAX_STOP_CHARS} characters and a "
             f"{STOP_REGEX_MAX_MEM >> 20} MiB automaton) or a list of at most "
             f"{MAX_STOP_REGEXES} of them")
        need(isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0
                                                           for t in self.stop_token_ids),
             "stop_token_ids", "a list of token ids")
        for name in ("no_stop_trim", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            need(isinstance(getattr(self, name), bool), name, "true or false")
        need(_is_int(self.n) and 1 <= self.n <= 128, "n", "an integer in [1, 128]")
        # the sampler keys its draws on int64 seeds; sample j of n uses seed + j
        need(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed
                                   and self.seed + (self.n if _is_int(self.n) else 1) <= 2**63),
             "seed", "an integer in the signed 64-bit range (seed + n - 1 included)")
        need(isinstance(self.logit_bias, dict)
             and all(_is_int(k) and k >= 0 and _is_num(v) for k, v in self.logit_bias.items()),
             "logit_bias", "an object of token id -> number")
        constraints = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        for name in constraints:
            need(isinstance(getattr(self, name), str) and getattr(self, name).strip() != "",
                 name, "a non-empty string")
        if len(constraints) > 1:
            raise SamplingParamsError(f"give at most one of json_schema, regex, ebnf and "
                                      f"structural_tag, got {' and '.join(constraints)}")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids),
                              ("logit_bias", list(self.logit_bias))):
                bad = [t for t in ids if t >= vocab_size]
                if bad:
                    raise SamplingParamsError(
                        f"{name} has token id {bad[0]}, outside the vocabulary (size {vocab_size})")
        for name in FLOAT_PARAMS:
            setattr(self, name, float(getattr(self, name)))
        self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()}

    @property
    def constraint(self) -> tuple[str, str] | None:
        """``(kind, spec)`` of the grammar constraint (``json_schema``, ``regex``, ``ebnf`` or
        ``structural_tag``), or None for free text."""
        return next(((kind, getattr(self, kind)) for kind in CONSTRAINT_KINDS
                     if getattr(self, kind) is not None), None)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


@functools.lru_cache(maxsize=256)
def stop_regex(pattern: str) -> Any:
    """``pattern`` compiled with RE2, whose matching takes time linear in the text (Python's
    ``re`` backtracks: ``(a|aa)+b`` over a run of ``a`` takes minutes, in the scheduler's loop);
    raises ``re2.error`` for a pattern RE2 refuses."""
    options = re2.Options()
    options.max_mem = STOP_REGEX_MAX_MEM
    options.log_errors = False
    return re2.compile(pattern, options)


def _is_regex(value: Any) -> bool:
    if not isinstance(value, str) or not value or len(value) > MAX_STOP_CHARS:
        return False
    try:
        stop_regex(value)
    except re2.error:
        return False
    return True
