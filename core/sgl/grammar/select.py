"""Choosing the grammar backend, and checking a request's constraint before it is sent.

Both processes use this: the scheduler to build its backend, the server process (through
:class:`GrammarChecker`, held by the TokenizerManager) to refuse a bad constraint with status 400
before anything is sent, so that a streamed request fails before its first byte too.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from sgl.grammar.base import GrammarError

if TYPE_CHECKING:
    from sgl.plugins import SglPluginManager
    from sgl.registry import Registry
    from sgl.sampling import SamplingParams

__all__ = ["DEFAULT_BACKEND", "GrammarChecker", "backend_kinds", "resolve_backend",
           "unsupported_message"]

logger = logging.getLogger("sgl.grammar")

#: the backend ``--grammar-backend auto`` picks when its plugin is installed
DEFAULT_BACKEND = "xgrammar"


def resolve_backend(setting: str | None, registry: Registry[Any]) -> str | None:
    """The backend name ``--grammar-backend`` means: ``auto`` (or unset) is xgrammar when a
    plugin registers it, else none; ``none`` is none."""
    if setting in (None, "auto"):
        return DEFAULT_BACKEND if DEFAULT_BACKEND in registry else None
    if setting == "none":
        return None
    return setting


def backend_kinds(registry: Registry[Any]) -> dict[str, frozenset[str]]:
    """The constraint kinds each registered backend can compile (classes whose module cannot
    be imported are left out)."""
    kinds = {}
    for entry in registry:
        try:
            kinds[entry.name] = frozenset(entry.load().kinds)
        except Exception as exc:  # a broken plugin must not break the others
            logger.warning("grammar backend %r cannot be loaded: %s", entry.name, exc)
    return kinds


def unsupported_message(backend: str | None, kind: str, kinds: dict[str, frozenset[str]]) -> str:
    """Why a ``kind`` constraint cannot be served, naming the backends that could serve it."""
    able = sorted(name for name, ks in kinds.items() if kind in ks)
    if backend is None:
        if not kinds:
            return (f"{kind} needs constrained decoding, and no grammar backend is installed; "
                    "install a grammar backend plugin such as sgl-grammar-xgrammar")
        return (f"{kind} needs constrained decoding, which is off (--grammar-backend none); "
                f"start the server with --grammar-backend {able[0] if able else DEFAULT_BACKEND}")
    if able:
        return (f"the {backend} grammar backend cannot compile {kind}; the "
                f"{' and '.join(able)} backend{'s' if len(able) > 1 else ''} can (start the "
                f"server with --grammar-backend {able[0]})")
    return f"the {backend} grammar backend cannot compile {kind}, and no installed backend can"


class GrammarChecker:
    """Checks the constraint of a request in the server process: a backend is on and can
    compile its kind, and the backend's :meth:`~sgl.grammar.BaseGrammarBackend.validate` accepts
    its syntax. Results are remembered for the last 256 constraints."""

    def __init__(self, backend: str | None, registry: Registry[Any]) -> None:
        self.backend = backend
        self.kinds = backend_kinds(registry)
        self.cls = registry.load(backend) if backend is not None and backend in registry else None
        self._seen: OrderedDict[tuple[str, str], str | None] = OrderedDict()

    @classmethod
    def for_server(cls, pm: SglPluginManager, grammar_backend: str) -> GrammarChecker:
        """The checker of the backend the scheduler reported it uses (``"none"``: none)."""
        backend = grammar_backend if grammar_backend != "none" else None
        return cls(backend, pm.registries.grammar)

    def check(self, params: SamplingParams) -> None:
        """Raise :class:`GrammarError` (or ValueError) naming the problem."""
        constraint = params.constraint
        if constraint is None:
            return
        kind, spec = constraint
        if self.cls is None or kind not in self.kinds.get(self.backend or "", ()):
            raise ValueError(unsupported_message(self.backend if self.cls else None, kind,
                                                 self.kinds))
        key = (kind, spec)
        if key not in self._seen:
            self._seen[key] = self._validate(kind, spec)
            if len(self._seen) > 256:
                self._seen.popitem(last=False)
        error = self._seen[key]
        if error is not None:
            raise ValueError(error)

    def _validate(self, kind: str, spec: str) -> str | None:
        if kind in ("json_schema", "structural_tag"):
            try:
                value = json.loads(spec)
            except json.JSONDecodeError as exc:
                return str(GrammarError(kind, f"not valid JSON: {exc}"))
            if not isinstance(value, (dict, bool)):
                return str(GrammarError(kind, f"expected a JSON object, got {type(value).__name__}"))
        try:
            if self.cls is not None:
                self.cls.validate(kind, spec)
        except GrammarError as exc:
            return str(exc)
        except Exception as exc:  # a library error the backend did not normalise
            return str(GrammarError(kind, str(exc)))
        return None
