"""The hooks of the example plugin. Kept light: heavy modules load only when used."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl import hookimpl


@dataclass(frozen=True)
class HelloSettings:
    greeting: str = field(default="Hello", metadata={"help": "What GET /hello says."})


@hookimpl
def sgl_add_config() -> type:
    return HelloSettings


@hookimpl
def sgl_register_frontends(register: Any) -> None:
    register("hello", "sgl_hello.routes:make_router")


@hookimpl
def sgl_register_attention_backends(register: Any) -> None:
    register("toy", "sgl_hello.attention:ToyAttentionBackend")
