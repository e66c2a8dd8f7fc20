"""Request shapes of Anthropic's Messages API (the subset sgl serves), and its error body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CountTokensRequest", "JsonOutputFormat", "Message", "MessagesRequest", "OutputConfig",
           "TextBlock", "error_body"]

#: HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    """A text content block (``cache_control`` and ``citations`` are accepted and ignored)."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class CountTokensRequest(_Strict):
    """The body of ``POST /v1/messages/count_tokens``."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "".join(block.text for block in self.system) or None


class JsonOutputFormat(_Strict):
    """Structured output: the reply is JSON that matches ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """``output_config`` (the current Anthropic client's way to ask for structured output):
    ``format`` runs on the grammar backends; ``effort`` is accepted and changes nothing (sgl has
    no reasoning budget)."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(CountTokensRequest):
    """The body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error JSON: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
