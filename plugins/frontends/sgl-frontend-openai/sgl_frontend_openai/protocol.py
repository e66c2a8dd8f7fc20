"""Request shapes of the OpenAI API (the subset sgl serves), as pydantic models.

Unknown fields are refused (status 400, naming the field) rather than silently ignored. A few
fields that only matter to OpenAI's own service (``store``, ``metadata``, ``service_tier``,
``parallel_tool_calls``, ``user``) are accepted and ignored, and so are SGLang's extensions that
sgl does not implement (:data:`UNSUPPORTED_SGLANG_FIELDS`) when they are empty, as SGLang's
router and clients send them. See the field table in docs/api.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sgl.server.io_struct import drop_unsupported

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest",
           "DetokenizeRequest", "FunctionDef", "ResponseFormat", "StreamOptions",
           "TokenizeRequest", "Tool", "ToolChoiceFunction", "error_body"]

#: SGLang's extensions of the OpenAI requests (its entrypoints/openai/protocol.py of late 2026)
#: that sgl does not implement: accepted when empty, a 400 naming the field otherwise
UNSUPPORTED_SGLANG_FIELDS = frozenset({
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_cached_tokens_details", "return_token_ids", "return_prompt_token_ids",
    "return_meta_info", "stop_regex", "lora_path", "session_id", "session_params",
    "custom_params", "custom_logit_processor", "images_config", "max_dynamic_patch",
    "min_dynamic_patch", "use_audio_in_video", "input_ids", "task", "rid", "extra_key",
    "cache_salt", "ngram_corpus_id", "priority", "routed_dp_rank", "disagg_prefill_dp_rank",
    "custom_labels",
})
#: of those, the ones accepted whatever their value (they change nothing here)
IGNORED_SGLANG_FIELDS = frozenset({"custom_labels", "session_id"})

#: the range of seeds the sampler takes (a signed 64-bit integer)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Strict):
    """A function the model may call."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class _NamedFunction(_Strict):
    name: str


class ToolChoiceFunction(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"] = "function"
    function: _NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ChatMessage(BaseModel):
    """One message of a chat. Content is a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        """The content as one string; refuses parts that are not text."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content part of type {part.get('type')!r} is not supported; "
                                     "only 'text' parts are")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class _SamplingFields(_Strict):
    """Fields that /v1/chat/completions and /v1/completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # sgl and SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    no_stop_trim: bool = False  # keep the stop string at the end of the text
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    regex: str | None = None  # constrained decoding (SGLang's extra body fields)
    ebnf: str | None = None
    response_format: ResponseFormat | None = None
    #: the data-parallel replica to run on (SGLang's router sends it with --dp-aware)
    data_parallel_rank: int | None = Field(default=None, ge=0)
    #: prefill/decode disaggregation: SGLang's router in PD mode adds these (checked by sgl's
    #: GenerateReqInput: a list holds one per choice when n > 1)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_sglang_extensions(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        return drop_unsupported(body, UNSUPPORTED_SGLANG_FIELDS, IGNORED_SGLANG_FIELDS)

    @model_validator(mode="after")
    def _check(self) -> _SamplingFields:
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("stop: at most 16 stop strings")
        for key, bias in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias: keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: values must be in [-100, 100], got {bias}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
            raise ValueError("seed: must fit in a signed 64-bit integer (with n choices, "
                             "seed + n - 1 must too)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        given = [name for name in ("regex", "ebnf", "response_format", "json_schema")
                 if getattr(self, name, None) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give at most one of {' and '.join(given)}")
        return self


class ChatCompletionRequest(_SamplingFields):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's extensions (its router sends them): continue the last assistant message instead of
    # starting a new one; the reasoning fields have no effect (no reasoning parser in sgl yet)
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # OpenAI's reasoning control; SGLang passes it to the chat template as thinking /
    # enable_thinking (false for "none"), and so does sgl
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None \
        = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is given")
        if isinstance(self.tool_choice, ToolChoiceFunction):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: the function {self.tool_choice.function.name!r} "
                                 f"is not among the tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: 'required' needs tools")
        return self


class CompletionRequest(_SamplingFields):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    json_schema: str | None = None  # SGLang's extension: a JSON schema, as text

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of equal to n is supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be an empty list")
        return self


class TokenizeRequest(_Strict):
    """The body of ``POST /v1/tokenize``: a prompt, or chat messages formatted by the
    chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    """The body of ``POST /v1/detokenize``."""

    model: str | None = None
    tokens: list[int]


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
