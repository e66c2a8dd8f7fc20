"""Named registries that plugins fill through ``sgl_register_*`` hooks.

A registry maps a name (``"torch"``, ``"LlamaForCausalLM"``) to a target: a ``"module:attr"``
string imported on first use, or the object itself. It remembers which plugin registered each
name so that a clash is reported with both plugins named.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["DuplicateRegistrationError", "Registry", "RegisterFn", "RegistryEntry", "UnknownNameError"]

T = TypeVar("T")
RegisterFn = Callable[[str, Any], None]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class DuplicateRegistrationError(RuntimeError):
    """Two plugins registered the same name in one registry."""


class UnknownNameError(LookupError):
    """A name that no installed plugin registered."""


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    target: Any
    owner: str

    def load(self) -> Any:
        """Import a ``"module:attr"`` target (or return the object registered directly)."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
        return obj


class Registry(Generic[T]):
    """Name -> target, filled by one registration hook of every plugin."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, RegistryEntry] = {}

    def register(self, name: str, target: Any, *, owner: str) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"plugin {owner!r} registered an invalid {self.kind} name {name!r}: use letters, "
                "digits, '_', '-' and '.'"
            )
        if isinstance(target, str) and ":" not in target:
            raise ValueError(
                f"plugin {owner!r} registered {self.kind} {name!r} with target {target!r}; "
                "expected 'module:attribute'"
            )
        existing = self._entries.get(name)
        if existing is not None and existing.owner != owner:
            raise DuplicateRegistrationError(
                f"{self.kind} {name!r} is registered by two plugins: {existing.owner!r} and "
                f"{owner!r}; disable one with --disable-plugin"
            )
        self._entries[name] = RegistryEntry(name, target, owner)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> RegistryEntry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "none installed"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; available: {known}") from None

    def load(self, name: str) -> T:
        return self.entry(name).load()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[RegistryEntry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
