"""The contract of tool-call parsers (hook ``sgl_register_tool_parsers``): how a model writes
function calls in its output, and what a frontend gets back.

A parser subclasses :class:`BaseToolParser`; frontends that accept ``tools`` pick one by name
from ``plugin_manager.registries.tool_parsers``. The OpenAI frontend plugin registers
``hermes`` and ``json``.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["BaseToolParser", "ParsedOutput", "ToolCall"]


@dataclass
class ToolCall:
    """One function call: the name and the arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as an item of OpenAI's ``tool_calls`` list (with ``index`` for a delta)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ParsedOutput:
    """A reply split into its text (None when nothing else was said) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


class BaseToolParser(ABC):
    """How one family of models writes tool calls."""

    #: the name under which the parser is registered
    name: ClassVar[str] = ""
    #: text that opens a call anywhere in a reply (None: a call is the whole reply)
    call_start: ClassVar[str | None] = None
    #: text that closes one call; a forced call stops there
    call_end: ClassVar[str | None] = None

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Whether this is the format of a model with this chat template (for ``auto``)."""
        return False

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """Split a finished reply into its text and its tool calls."""

    @abstractmethod
    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Instructions for a model whose chat template does not describe tools itself;
        ``tools`` are OpenAI tool objects."""

    @abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An earlier assistant turn's OpenAI ``tool_calls`` as the model would have written
        them, for templates that do not render ``tool_calls``."""

    @abstractmethod
    def forced_prefix(self, name: str | None) -> str:
        """The start of a reply that must call ``name`` (or any tool when None)."""

    def may_start_call(self, text: str) -> bool:
        """Whether a streamed reply that begins with ``text`` may turn out to be a call, so
        it must be held back until it is finished."""
        return True
