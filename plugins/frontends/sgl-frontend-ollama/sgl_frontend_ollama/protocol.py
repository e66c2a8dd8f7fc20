"""Request shapes of the Ollama API (the subset sgl serves)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatMessage", "ChatRequest", "GenerateRequest", "Options", "ShowRequest"]

#: Ollama's own defaults where a request leaves an option out
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Options(_Strict):
    """Ollama's ``options``. Sampling options are applied; runtime options of llama.cpp
    (``num_ctx``, ``num_thread``, ``num_gpu``, ...) are accepted and ignored, since sgl sizes
    its context and threads at start-up."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    num_predict: int | None = Field(default=None, ge=-2)
    stop: list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    repeat_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # accepted, without effect here
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    repeat_last_n: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class _Base(_Strict):
    model: str = Field(min_length=1)
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatRequest(_Base):
    """The body of ``POST /api/chat``."""

    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Base):
    """The body of ``POST /api/generate``."""

    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class ShowRequest(_Strict):
    """The body of ``POST /api/show`` (``name`` is the older spelling of ``model``)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None
