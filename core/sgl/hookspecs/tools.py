"""Tool-call parsers: how a model writes function calls in its output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_tool_parsers(register: RegisterFn) -> None:
    """Register tool-call parsers by name.

    Call ``register(name, "module:Class")``. The class subclasses
    :class:`sgl.tools.BaseToolParser`: it turns a model's raw output into text
    and tool calls (``parse``), writes the prompt that tells a model without tool support in its
    chat template how to call tools (``system_prompt``), renders earlier calls back into the
    chat (``render_calls``) and gives the text that starts a forced call (``forced_prefix``).
    Frontends that accept ``tools`` (the OpenAI frontend) pick one by name from
    ``plugin_manager.registries.tool_parsers``: their
    ``tool_call_parser`` setting, or ``auto`` (a parser whose ``matches(chat_template)`` claims
    the model's template, else ``hermes``). Two plugins registering one name is an error naming
    both.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: the server process, when a frontend that parses tool calls builds its router.

    .. versionadded:: 0.1
    """
