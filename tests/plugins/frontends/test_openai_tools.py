"""Tool calls: the parsers on crafted text, the ``sgl_register_tool_parsers`` hook, and tool
requests end to end through the ``openai`` client."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from sgl import hookimpl
from sgl.registry import UnknownNameError
from sgl_testing import ServerProcess, run_cli
from sgl.tools import BaseToolParser, ParsedOutput
from sgl_frontend_openai.tool_parsers import HermesToolParser, JsonToolParser, select_tool_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


# --- the parsers ------------------------------------------------------------------------------

def test_hermes_parses_calls_and_keeps_the_text() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    out = HermesToolParser().parse(text)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in out.tool_calls}) == 2


def test_hermes_without_calls_is_plain_text() -> None:
    assert HermesToolParser().parse("Paris is sunny.") == ParsedOutput("Paris is sunny.", [])
    # a tag with no readable call inside stays text
    broken = "<tool_call>not json at all</tool_call>"
    assert HermesToolParser().parse(broken) == ParsedOutput(broken, [])


def test_hermes_reads_an_unterminated_or_trailing_call() -> None:
    out = HermesToolParser().parse('<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Rome"}}')
    assert out.content is None and out.tool_calls[0].name == "get_weather"
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Rome"}
    out = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"a": 1}} extra')
    assert json.loads(out.tool_calls[0].arguments) == {"a": 1}


def test_json_parser_reads_objects_lists_fences_and_parameters() -> None:
    parser = JsonToolParser()
    out = parser.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert out.content is None and json.loads(out.tool_calls[0].arguments) == {"city": "Oslo"}
    out = parser.parse('```json\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
                       '"{\\"x\\": 2}"}]\n```')
    assert [c.name for c in out.tool_calls] == ["a", "b"]
    assert json.loads(out.tool_calls[1].arguments) == {"x": 2}
    assert parser.parse("Just words.") == ParsedOutput("Just words.", [])
    assert parser.parse('{"city": "Oslo"}').tool_calls == []  # JSON, but not a call


def test_system_prompts_describe_the_tools_and_calls_render_back() -> None:
    for parser in (HermesToolParser(), JsonToolParser()):
        prompt = parser.system_prompt([WEATHER])
        assert "get_weather" in prompt and "Get the current weather" in prompt
        rendered = parser.render_calls([{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}])
        call = parser.parse(rendered).tool_calls[0]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        forced = parser.forced_prefix("get_weather") + '{"city": "Lima"}}'
        call = parser.parse(forced).tool_calls[0]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lima"}


def test_streaming_hold_back_decision() -> None:
    hermes, plain = HermesToolParser(), JsonToolParser()
    assert hermes.may_start_call("") and hermes.may_start_call(" <tool")
    assert not hermes.may_start_call("Hello")
    assert plain.may_start_call('{"na') and not plain.may_start_call("Sure")


# --- the hook and the selection ---------------------------------------------------------------

class EchoParser(HermesToolParser):
    name = "echo"

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return "<echo-tools>" in chat_template


def test_hook_sgl_register_tool_parsers(plugin_manager, register_plugin) -> None:
    class Plugin:
        @hookimpl
        def sgl_register_tool_parsers(self, register):
            register("echo", EchoParser)

    register_plugin(Plugin(), name="echo-plugin")
    registry = plugin_manager.registries.tool_parsers
    assert {"hermes", "json", "echo"} <= set(registry.names())
    assert registry.entry("echo").owner == "echo-plugin"
    assert registry.entry("hermes").owner == "frontend-openai"
    assert isinstance(select_tool_parser(registry, "auto", "{{ '<echo-tools>' }}"), EchoParser)
    assert isinstance(select_tool_parser(registry, "auto", "{{ messages }}"), HermesToolParser)
    assert isinstance(select_tool_parser(registry, "json", None), JsonToolParser)
    with pytest.raises(UnknownNameError, match="hermes"):
        select_tool_parser(registry, "nope", None)


def test_auto_picks_hermes_for_a_qwen_style_template(plugin_manager) -> None:
    registry = plugin_manager.registries.tool_parsers
    template = "{% if tools %}<tools>{{ tools }}</tools> <tool_call>{% endif %}"
    assert type(select_tool_parser(registry, "auto", template)) is HermesToolParser
    assert issubclass(registry.load("json"), BaseToolParser)


# --- end to end -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.slow
def test_named_tool_choice_returns_a_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=ASK, temperature=0, max_tokens=48, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and isinstance(call.function.arguments, str)


@pytest.mark.slow
def test_required_tool_choice_streams_a_call(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="default", messages=ASK, temperature=0,
                                           max_tokens=48, tools=[WEATHER],
                                           tool_choice="required")
    chunks = list(client.chat.completions.create(
        model="default", messages=ASK, temperature=0, max_tokens=48, tools=[WEATHER],
        tool_choice="required", stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].index == 0 and calls[0].type == "function"
    expected = whole.choices[0].message.tool_calls[0].function
    assert (calls[0].function.name, calls[0].function.arguments) == \
        (expected.name, expected.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_tool_conversation_round_trip_and_none(client: openai.OpenAI) -> None:
    """A full turn: the earlier call and the tool's result go back in; the reply is text or a
    call, always in a valid shape. ``tool_choice: none`` never parses calls."""
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = client.chat.completions.create(model="default", messages=messages, temperature=0,
                                       max_tokens=24, tools=[WEATHER])
    message = r.choices[0].message
    assert (message.content is not None) or message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model="default", messages=ASK, temperature=0,
                                       max_tokens=24, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("pieces", [1, 3, 100])
def test_stream_splitter_sends_text_at_once_and_holds_calls(pieces: int) -> None:
    """Streaming with tools: text before a call streams, the call is held and parsed at the
    end, and a '<' that starts no call is sent in the end too."""
    from sgl.server.io_struct import GenerateReqInput
    from sgl_frontend_openai.chat import _Plan, _ReplySplitter

    def run(reply: str, **plan: Any) -> tuple[str, str, list[dict[str, Any]]]:
        splitter = _ReplySplitter(HermesToolParser(), _Plan(GenerateReqInput(text="x"), **plan))
        sent = "".join(splitter.feed(reply[i:i + pieces]) for i in range(0, len(reply), pieces))
        rest, calls = splitter.finish()
        return sent, rest, calls

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    sent, rest, calls = run("Let me check. " + call, tools=True)
    assert sent == "Let me check. " and rest == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    sent, rest, calls = run(call, tools=True)
    assert sent == "" and len(calls) == 1
    sent, rest, calls = run("1 < 2 and <tool", tools=True)
    assert sent + rest == "1 < 2 and <tool" and calls == []
    assert run("plain <tool_call>", tools=False) == ("plain <tool_call>", "", [])
    sent, rest, calls = run('{"city": "Rome"}}', tools=True, forced=True,
                            prefix=HermesToolParser().forced_prefix("get_weather"))
    assert sent == "" and rest == "" and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Rome"}


def test_tool_call_parser_option_round_trips(tmp_path) -> None:
    """``tool_call_parser`` from a flag, the environment and a config file, as
    ``sgl config show`` reports it (a plugin id with a dash in its flags and variables)."""
    def shown(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        result = run_cli(["config", "show", "--json", *args], env=env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["plugins.frontend-openai.tool_call_parser"]

    assert shown()["value"] == "auto"
    assert shown("--frontend-openai-tool-call-parser", "json") == {
        "value": "json", "source": "flag --frontend-openai-tool-call-parser"}
    assert shown(env={"SGL_FRONTEND_OPENAI_TOOL_CALL_PARSER": "hermes"})["value"] == "hermes"
    config = tmp_path / "sgl.toml"
    config.write_text('[plugins.frontend-openai]\ntool_call_parser = "json"\n')
    assert shown("--config", str(config))["value"] == "json"
