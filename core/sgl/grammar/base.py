"""The interface of grammar backends (constrained decoding).

A backend turns a constraint (a JSON schema, a regular expression, an EBNF grammar or an
xgrammar structural tag) into a *compiled grammar* once, and makes one *matcher* per request from
it. The scheduler caches compiled grammars by constraint, compiles in child processes bounded in
time and memory (:mod:`sgl.grammar.worker`), and asks the matchers of a batch to fill one
shared int32 token bitmask (bit ``j`` of word ``i`` allows token ``32 * i + j``: the layout
xgrammar, llguidance and outlines-core all use).
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

__all__ = ["CONSTRAINT_KINDS", "BaseGrammarBackend", "BaseGrammarMatcher", "GrammarError"]

#: the constraint kinds, named as SGLang's sampling parameters name them
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """A constraint the backend cannot compile; the message is for the user (status 400)."""

    def __init__(self, kind: str, detail: str) -> None:
        detail = " ".join(str(detail).split())  # libraries put newlines and carets in theirs
        if len(detail) > 400:
            detail = detail[:400] + " ..."
        super().__init__(f"invalid {kind}: {detail}")
        self.kind = kind


class BaseGrammarMatcher(ABC):
    """The state of one request's grammar: which tokens may come next."""

    @abstractmethod
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bitmask of the next step into ``bitmask[row]`` (int32,
        ``ceil(vocab_size / 32)`` words per row)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar rejects it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the output is complete (a stop token was accepted, or nothing else may
        follow); the request then finishes with ``finish_reason`` ``stop``."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (for speculative decoding and for
        jump-forward tokens the grammar refuses half-way)."""

    def find_jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model would say: appended without
        sampling (jump-forward decoding). They are not accepted yet; the caller accepts them one
        by one. Empty when the next token is a real choice (the default: no jump-forward)."""
        return []


class BaseGrammarBackend(ABC):
    """Compiles constraints into grammars for one tokenizer; makes a matcher per request.

    Built once per scheduler process (on a grammar worker thread, not the scheduler's) with the
    model's tokenizer, vocabulary size (the width of the logits) and stop token ids, and again
    in each compile worker (:mod:`sgl.grammar.worker`: a child process bounded in time and
    memory, since a client's constraint can cost exponential time to compile). :meth:`compile`
    and :meth:`serialize` run in a worker; :meth:`deserialize`, :meth:`new_matcher` and the
    matchers in the scheduler process.
    """

    #: the registered name, for messages
    name: ClassVar[str] = ""
    #: the constraint kinds (of :data:`CONSTRAINT_KINDS`) this backend can compile
    kinds: ClassVar[frozenset[str]] = frozenset({"json_schema", "regex", "ebnf"})

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()
                 ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)

    @classmethod
    def validate(cls, kind: str, spec: str) -> None:
        """Check a constraint's syntax without a tokenizer (cheap; runs in the server process
        before the request is sent). Raise :class:`GrammarError`; the default checks nothing
        beyond :meth:`compile`'s own errors, which then come from the scheduler."""

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Any:
        """Compile a constraint of ``kind`` (one of :attr:`kinds`) into an object that
        :meth:`new_matcher` turns into matchers; it is cached and shared by every request with
        the same constraint. Raise :class:`GrammarError` when ``spec`` is invalid."""

    def serialize(self, compiled: Any) -> bytes:
        """``compiled`` (from :meth:`compile`, in a compile worker) as bytes for the scheduler
        process; the default pickles it."""
        return pickle.dumps(compiled, protocol=pickle.HIGHEST_PROTOCOL)

    def deserialize(self, data: bytes) -> Any:
        """The compiled grammar that :meth:`serialize` wrote (in the scheduler process, with
        this backend's tokenizer); the default unpickles it."""
        return pickle.loads(data)  # noqa: S301 - written by sgl's own compile worker

    @abstractmethod
    def new_matcher(self, compiled: Any) -> BaseGrammarMatcher:
        """A fresh matcher at the start of the grammar ``compiled``."""
