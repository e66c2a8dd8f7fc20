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
from typing import TYPE_CHECKING, Any

from sgl.tools import BaseToolParser, ParsedOutput, ToolCall

if TYPE_CHECKING:
    from sgl.registry import Registry

__all__ = ["HermesToolParser", "JsonToolParser", "parse_call_json", "select_tool_parser"]

_DECODER = json.JSONDecoder()


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


def _as_written(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` item as the model writes a call: name and arguments object."""
    fn = call.get("function", call)
    args = fn.get("arguments", "{}")
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        value = args
    return {"name": fn.get("name"), "arguments": value}


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
        return "\n".join(f"{self.START}\n{json.dumps(_as_written(c), ensure_ascii=False)}\n"
                         f"{self.END}" for c in calls)

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
        out = [_as_written(c) for c in calls]
        return json.dumps(out[0] if len(out) == 1 else out, ensure_ascii=False)

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(name)}, "arguments": '

    def may_start_call(self, text: str) -> bool:
        return text.lstrip()[:1] in ("", "{", "[", "`")


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
