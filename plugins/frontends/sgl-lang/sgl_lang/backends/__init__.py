"""Backends of the language: sgl's (or SGLang's) server, the in-process engine, OpenAI."""

from __future__ import annotations

from sgl_lang.backends.base import BaseBackend, NativeBackend
from sgl_lang.backends.engine import EngineBackend
from sgl_lang.backends.openai import OpenAI
from sgl_lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["BaseBackend", "EngineBackend", "NativeBackend", "OpenAI", "RuntimeEndpoint"]
