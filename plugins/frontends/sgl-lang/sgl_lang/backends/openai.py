"""``OpenAI(model, base_url=...)``: an OpenAI-compatible server through the ``openai`` client.

A program that uses chat roles generates with ``/v1/chat/completions`` (each ``gen`` must be the
whole content of an ``assistant`` turn); one without roles uses ``/v1/completions`` on its text.
``select`` scores the choices with prompt logprobs (``/v1/completions`` with ``echo`` and
``logprobs``), which sgl's server returns; a server that does not return them gets a clear error.
"""

from __future__ import annotations

from typing import Any

from sgl_lang.backends.base import BaseBackend, choice_logprobs
from sgl_lang.chat_template import ChatTemplate, get_template
from sgl_lang.errors import BackendError

__all__ = ["OpenAI"]


class OpenAI(BaseBackend):
    """:param model: the model name the server serves. Other keyword arguments (``base_url``,
    ``api_key``, ``timeout``, ...) go to ``openai.OpenAI``."""

    def __init__(self, model: str, chat_template: str | None = None, **client_args: Any) -> None:
        try:
            import openai
        except ImportError:
            raise BackendError("sgl.OpenAI needs the openai package: "
                               "pip install 'sgl-lang[openai]'") from None
        self._openai = openai
        client_args.setdefault("api_key", "unused")
        self.client = openai.OpenAI(**client_args)
        self.model = model
        # role text only matters for the state's text; the server formats the messages itself
        self.chat_template: ChatTemplate = get_template(chat_template or "default")

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(model=self.model, **kwargs)
        except self._openai.APIConnectionError as exc:
            raise BackendError(f"cannot reach the OpenAI-compatible server: {exc}") from None
        except self._openai.APIStatusError as exc:
            raise BackendError(f"the OpenAI-compatible server answered {exc.status_code}: "
                               f"{exc.message}", exc.status_code) from None

    @staticmethod
    def _params(params: Any) -> dict[str, Any]:
        p = params.to_sgl()
        if "regex" in p or "json_schema" in p:
            raise BackendError("gen(regex=..., json_schema=...) is not supported by the "
                               "OpenAI backend; use RuntimeEndpoint", 400)
        out = {"max_tokens": p.get("max_new_tokens", 128)}
        for key in ("stop", "temperature", "top_p", "frequency_penalty", "presence_penalty"):
            if key in p:
                out[key] = p[key]
        extra = {k: p[k] for k in ("top_k", "min_p", "stop_token_ids", "min_new_tokens")
                 if k in p}
        if "min_new_tokens" in extra:
            extra["min_tokens"] = extra.pop("min_new_tokens")
        if extra:
            out["extra_body"] = extra
        return out

    def generate(self, s, params, logprobs=None):
        if s.messages_ or s.cur_role is not None:
            if s.cur_role != "assistant":
                raise BackendError("with chat roles the OpenAI backend generates only the whole "
                                   "content of an assistant() turn")
            begin = s.cur_role_begin + len(self.chat_template.prefix("assistant"))
            if s.text_[begin:]:
                raise BackendError("the OpenAI backend cannot continue an assistant turn that "
                                   "already has text; put gen() first in assistant()")
            out = self._call(self.client.chat.completions.create, messages=s.messages_,
                             **self._params(params))
            text = out.choices[0].message.content or ""
        else:
            out = self._call(self.client.completions.create, prompt=s.text_,
                             **self._params(params))
            text = out.choices[0].text
        return text, {"finish_reason": out.choices[0].finish_reason,
                      "prompt_tokens": out.usage.prompt_tokens if out.usage else None,
                      "completion_tokens": out.usage.completion_tokens if out.usage else None}

    def _prompt_logprobs(self, text: str) -> list[tuple[float | None, str | None]]:
        """``(logprob, token text)`` of each prompt token."""
        out = self._call(self.client.completions.create, prompt=text, max_tokens=0, echo=True,
                         logprobs=0)
        logprobs = out.choices[0].logprobs
        if logprobs is None or not logprobs.token_logprobs:
            raise BackendError("select needs prompt logprobs (/v1/completions with echo and "
                               "logprobs), which this server does not return")
        tokens = list(logprobs.tokens or [None] * len(logprobs.token_logprobs))
        return list(zip(logprobs.token_logprobs, tokens))

    def select(self, s, choices, temperature, method):
        if s.messages_ or s.cur_role is not None:
            raise BackendError("select inside chat roles is not supported by the OpenAI backend: "
                               "chat completions return no prompt logprobs")
        start = max(len(self._prompt_logprobs(s.text_)) - 2, 0)
        token_logprobs = [choice_logprobs(s.text_, self._prompt_logprobs(s.text_ + c)[start:])
                          for c in choices]
        unconditional = None
        if method.requires_unconditional:
            unconditional = [[lp for lp, _ in self._prompt_logprobs(c) if lp is not None]
                             for c in choices]
        return method(choices, token_logprobs, unconditional)

    def __repr__(self) -> str:
        return f"OpenAI({self.model!r}, base_url={str(self.client.base_url)!r})"
