"""What the interpreter asks of a backend, and the shared logic of backends that speak SGLang's
native ``/generate`` (sgl's server over HTTP, SGLang's server, the in-process ``sgl.Engine``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sgl_lang.chat_template import ChatTemplate, detect_template, get_template

if TYPE_CHECKING:
    from sgl_lang.choices import ChoicesDecision, ChoicesMethod
    from sgl_lang.interpreter import StreamExecutor
    from sgl_lang.ir import SamplingParams

__all__ = ["BaseBackend", "NativeBackend"]

GenResult = tuple[str, dict[str, Any]]


class BaseBackend:
    """A backend generates text for a program state and scores ``select`` choices."""

    chat_template: ChatTemplate = get_template("default")
    #: becomes False once the backend refused a ``regex`` (no grammar backend)
    supports_regex = True

    def cache_prefix(self, prefix: str) -> int | None:
        """Put ``prefix`` in the backend's prefix cache; return its token count if known."""
        return None

    def generate(self, s: StreamExecutor, params: SamplingParams,
                 logprobs: dict[str, Any] | None = None) -> GenResult:
        """Generate after ``s``'s text; ``logprobs``: SGLang's logprob fields to ask for
        (``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ...)."""
        raise NotImplementedError

    def generate_stream(self, s: StreamExecutor, params: SamplingParams,
                        logprobs: dict[str, Any] | None = None
                        ) -> Iterator[tuple[str, dict | None]]:
        text, meta = self.generate(s, params, logprobs)
        yield text, meta

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               method: ChoicesMethod) -> ChoicesDecision:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


def choice_logprobs(prefix: str, scored: list[tuple[float | None, str | None]]) -> list[float]:
    """A select choice's logprobs, as SGLang's frontend scores them: ``scored`` holds
    ``(logprob, token text)`` from two tokens before the end of ``prefix`` (so that a choice
    that merges with the prefix's last token still has tokens to score) through the choice; the
    first is left out where ``prefix`` still ends with it."""
    if scored and scored[0][1] is not None and prefix.endswith(scored[0][1]):
        scored = scored[1:]
    return [lp for lp, _ in scored if lp is not None]


def _token_logprobs(entries: list[Any]) -> list[float]:
    """The logprob of each ``[logprob, token_id, text]`` entry that has one."""
    return [e[0] for e in entries if e[0] is not None]


class NativeBackend(BaseBackend):
    """A backend that answers SGLang's ``/generate`` bodies. Subclasses implement
    :meth:`_generate` (one body, a dict or a list of dicts back) and :meth:`_generate_stream`
    (the events of a streamed body, each with the full text so far)."""

    def _generate(self, body: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _generate_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def _pick_template(self, chat_template: str | None, rendered: str | None,
                       model_name: str) -> None:
        self.chat_template = (get_template(chat_template) if chat_template
                              else detect_template(rendered, model_name))

    def cache_prefix(self, prefix: str) -> int:
        out = self._generate({"text": prefix, "sampling_params": {"max_new_tokens": 0}})
        return out["meta_info"]["prompt_tokens"]

    def generate(self, s, params, logprobs=None):
        body = {"text": s.text_, "sampling_params": params.to_sgl(), **(logprobs or {})}
        out = self._generate(body)
        return out["text"], out["meta_info"]

    def generate_stream(self, s, params, logprobs=None):
        body = {"text": s.text_, "sampling_params": params.to_sgl(), "stream": True,
                **(logprobs or {})}
        sent = ""
        for event in self._generate_stream(body):
            text = event["text"]
            meta = event["meta_info"] if event["meta_info"].get("finish_reason") else None
            yield text[len(sent):], meta
            sent = text

    def select(self, s, choices, temperature, method):
        # the shared prefix once (its token count, and it lands in the cache), then every
        # choice after it in one batch, with logprobs from two tokens before the prefix's end:
        # a choice may merge with the prefix's last token ("Answer: " + "no" ends in " no"),
        # and then the prefix+choice has no more tokens than the prefix. As SGLang scores it:
        # the first of those entries is dropped where it is still the prefix's own token
        prefix_len = self.cache_prefix(s.text_)
        outs = self._generate({
            "text": [s.text_ + c for c in choices],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": max(prefix_len - 2, 0),
            "return_text_in_logprobs": True})
        token_logprobs = [choice_logprobs(s.text_, [(e[0], e[2]) for e in
                                                    o["meta_info"]["input_token_logprobs"]])
                          for o in outs]
        unconditional = None
        if method.requires_unconditional:
            outs = self._generate({
                "text": list(choices), "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": 0})
            unconditional = [_token_logprobs(o["meta_info"]["input_token_logprobs"])
                             for o in outs]
        decision = method(choices, token_logprobs, unconditional)
        decision.meta_info["prefix_tokens"] = prefix_len
        return decision
