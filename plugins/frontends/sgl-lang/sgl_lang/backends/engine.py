"""``EngineBackend(engine)``: the in-process ``sgl.Engine``, without HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sgl_lang.backends.base import NativeBackend
from sgl_lang.errors import BackendError

if TYPE_CHECKING:
    from sgl.entrypoints.engine import Engine

__all__ = ["EngineBackend"]

_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
           "return_text_in_logprobs")


class EngineBackend(NativeBackend):
    """Runs programs on an ``sgl.Engine`` of this process; ``sgl.set_default_backend(engine)``
    wraps the engine in one. The chat template is chosen from the engine's own template."""

    def __init__(self, engine: Engine, chat_template: str | None = None) -> None:
        self.engine = engine
        rendered = None
        if not chat_template:
            try:
                ids = engine.apply_chat_template([{"role": "user", "content": "hi"}])
                rendered = engine.tokenizer.decode(ids)
            except Exception:  # a model without a chat template
                rendered = None
        self._pick_template(chat_template, rendered, str(engine.settings.model_path or ""))

    def _call(self, body: dict[str, Any], stream: bool = False) -> Any:
        from sgl.entrypoints.engine import BadRequestError, GenerateError

        kwargs = {k: body[k] for k in _FIELDS if k in body}
        try:
            return self.engine.generate(body["text"], body["sampling_params"], stream=stream,
                                        **kwargs)
        except BadRequestError as exc:
            raise BackendError(f"the engine refused the request: {exc}", 400) from None
        except GenerateError as exc:
            raise BackendError(f"generation failed: {exc}", 500) from None

    def _generate(self, body: dict[str, Any]) -> Any:
        return self._call(body)

    def _generate_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        # the engine's chunks hold only the new text; the base class wants the text so far
        text = ""
        for chunk in self._call(body, stream=True):
            text += chunk["text"]
            yield {**chunk, "text": text}

    def __repr__(self) -> str:
        return f"EngineBackend({self.engine!r})"
