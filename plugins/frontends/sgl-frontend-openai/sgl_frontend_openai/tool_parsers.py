"""Tool-call parsers: from a model's raw output to OpenAI ``tool_calls``, and back.

Parsers are registered through the ``sgl_register_tool_parsers`` hook; this plugin registers
two:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the format of
  Hermes, Qwen 2.5/3 and many other chat templates. The default when no parser claims the
  model's template (SmolLM2's template has no tool format of its own).
* ``json``: the whole reply is one JSON object ``{"name": ..., "arguments": {...}}`` (or
  ``"parameters"``, as Llama 3.x writes it), a list of them, or either inside a Markdown fence.

When the chat template itself does not mention ``tools``, the parser's :meth:`system_prompt`
tells the model how to call them. A forced call (``tool_choice`` ``"required"`` or a named
function) is made by starting the reply with :meth:`forced_prefix`, so even a small model
completes a call in the right shape.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from sgl.registry import Registry

if TYPE_CHECKING:
    from sgl.plugins import SglPluginManager

__all__ = ["BaseToolParser", "HermesToolParser", "JsonToolParser", "ParsedOutput", "ToolCall",
           "build_tool_parser_registry", "select_tool_parser"]

_DECODER = json.JSONDecoder()


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


def _arguments_text(value: Any) -> str:
    if isinstance(value, str):  # some models write the arguments as a JSON string already
        try:
            json.loads(value)
            return value
        except json.JSONDecodeError:
            return json.dumps(value)
    return json.dumps({} if value is None else value, ensure_ascii=False)


def _call_from(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return ToolCall(obj["name"], _arguments_text(args))


def _salvage_call(body: str) -> ToolCall | None:
    """A call from text that is not quite JSON (cut off, or followed by more text): the name,
    and the arguments object if one can be read, else the raw text of it."""
    name = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    if name is None:
        return None
    args = re.search(r'"(?:arguments|parameters)"\s*:\s*', body)
    if args is None:
        return ToolCall(name.group(1), "{}")
    rest = body[args.end():]
    try:
        value, _ = _DECODER.raw_decode(rest)
        return ToolCall(name.group(1), _arguments_text(value))
    except json.JSONDecodeError:
        end = rest.rfind("}")
        raw = rest[:end].strip() if end > 0 else ""
        return ToolCall(name.group(1), raw if raw.startswith("{") else "{}")


def parse_call_json(body: str) -> list[ToolCall]:
    """Calls from JSON text: one object, a list of objects, or a salvageable fragment."""
    body = body.strip()
    try:
        value, _ = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        call = _salvage_call(body)
        return [call] if call else []
    items = value if isinstance(value, list) else [value]
    calls = [c for c in (_call_from(item) for item in items) if c is not None]
    if not calls and isinstance(value, dict):
        call = _salvage_call(body)
        return [call] if call else []
    return calls


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


def _tools_json(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)


class HermesToolParser(BaseToolParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, one block per call."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    call_start, call_end = START, END
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return cls.START in chat_template

    def parse(self, text: str) -> ParsedOutput:
        if self.START not in text:
            return ParsedOutput(text, [])
        calls: list[ToolCall] = []
        for block in self._BLOCK.finditer(text):
            calls.extend(parse_call_json(block.group(1)))
        content = self._BLOCK.sub("", text).strip()
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(content or None, calls)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call one or more functions to help with the user's request. The "
                "functions are described in JSON within <tools></tools>:\n<tools>\n"
                f"{_tools_json(tools)}\n</tools>\n"
                "To call a function, reply with a JSON object with its name and arguments "
                "within <tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        parts = []
        for call in calls:
            fn = call.get("function", call)
            args = fn.get("arguments", "{}")
            try:
                args_value = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                args_value = args
            parts.append(f"{self.START}\n" + json.dumps({"name": fn.get("name"),
                                                           "arguments": args_value},
                                                          ensure_ascii=False) + f"\n{self.END}")
        return "\n".join(parts)

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return f'{self.START}\n{{"name": "'
        return f'{self.START}\n{{"name": {json.dumps(name)}, "arguments": '

    def may_start_call(self, text: str) -> bool:
        return self.START.startswith(text.lstrip()[:len(self.START)])


class JsonToolParser(BaseToolParser):
    """The whole reply is a JSON call (or a list of calls), possibly in a Markdown fence."""

    name = "json"
    _FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        fenced = self._FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        if not body.startswith(("{", "[")):
            return ParsedOutput(text, [])
        calls = parse_call_json(body)
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You have access to these functions, described in JSON:\n"
                f"{_tools_json(tools)}\n"
                "To call a function, reply with only a JSON object of the form "
                '{"name": <function-name>, "arguments": <args-json-object>} and nothing else.')

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        out = []
        for call in calls:
            fn = call.get("function", call)
            args = fn.get("arguments", "{}")
            try:
                args_value = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                args_value = args
            out.append({"name": fn.get("name"), "arguments": args_value})
        return json.dumps(out[0] if len(out) == 1 else out, ensure_ascii=False)

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(name)}, "arguments": '

    def may_start_call(self, text: str) -> bool:
        return text.lstrip()[:1] in ("", "{", "[", "`")


def build_tool_parser_registry(pm: SglPluginManager) -> Registry[type[BaseToolParser]]:
    """Every tool-call parser the loaded plugins register through
    ``sgl_register_tool_parsers``."""
    registry: Registry[type[BaseToolParser]] = Registry("tool-call parser")

    def register_for(owner: str) -> Any:
        return lambda name, target: registry.register(name, target, owner=owner)

    for _ in pm.call_each("sgl_register_tool_parsers", per_plugin={"register": register_for}):
        pass
    return registry


def select_tool_parser(registry: Registry[type[BaseToolParser]], setting: str,
                       chat_template: str | None) -> BaseToolParser:
    """The parser named by ``setting``; for ``auto`` the first whose ``matches`` claims the
    chat template, else ``hermes``. An unknown name raises the registry's error listing the
    registered ones."""
    if setting != "auto":
        return registry.load(setting)()
    for entry in registry:
        cls = entry.load()
        if chat_template and cls.matches(chat_template):
            return cls()
    return registry.load("hermes")()
