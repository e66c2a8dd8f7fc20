"""Registers the OpenAI frontend, its settings and its two tool-call parsers. No heavy imports
here: the router is built on demand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl import hookimpl


@dataclass(frozen=True)
class OpenAISettings:
    """Settings of the OpenAI frontend (``--frontend-openai-<field>``)."""

    tool_call_parser: str = field(default="auto", metadata={
        "help": "How tool calls are read from the model's output: a registered tool-call parser "
                "(hermes, json, or one from a plugin), or auto: the parser that recognises the "
                "model's chat template, else hermes."})


@hookimpl
def sgl_add_config() -> type:
    return OpenAISettings


@hookimpl
def sgl_register_frontends(register: Any) -> None:
    register("openai", "sgl_frontend_openai.routes:make_router")


@hookimpl
def sgl_register_tool_parsers(register: Any) -> None:
    register("hermes", "sgl_frontend_openai.tool_parsers:HermesToolParser")
    register("json", "sgl_frontend_openai.tool_parsers:JsonToolParser")
