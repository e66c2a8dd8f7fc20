"""The names a program uses: ``gen``, ``select``, the roles, ``set_default_backend``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from sgl_lang.ir import (
    ExprList, Gen, Image, RoleBegin, RoleEnd, SamplingParams, Select, to_expr,
)

if TYPE_CHECKING:
    from sgl_lang.backends.base import BaseBackend
    from sgl_lang.choices import ChoicesMethod

__all__ = [
    "assistant", "assistant_begin", "assistant_end", "gen", "gen_int", "gen_string",
    "get_default_backend", "image", "select", "set_default_backend", "system", "system_begin",
    "system_end", "user", "user_begin", "user_end",
]

_default_backend: BaseBackend | None = None


def as_backend(backend: Any) -> BaseBackend | None:
    """A backend as given, or an ``sgl.Engine`` wrapped in an ``EngineBackend``."""
    engine_module = sys.modules.get("sgl.entrypoints.engine")
    if engine_module is not None and isinstance(backend, engine_module.Engine):
        from sgl_lang.backends.engine import EngineBackend

        wrapped = getattr(backend, "_sgl_lang_backend", None)
        if wrapped is None:  # one per engine: it asks the engine for its chat template once
            wrapped = backend._sgl_lang_backend = EngineBackend(backend)
        return wrapped
    return backend


def set_default_backend(backend: Any) -> None:
    """The backend programs run on unless ``run(backend=...)`` says otherwise: a
    ``RuntimeEndpoint``, an ``OpenAI``, an ``EngineBackend`` or an ``sgl.Engine``."""
    global _default_backend
    _default_backend = as_backend(backend)


def get_default_backend() -> BaseBackend | None:
    return _default_backend


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    stop_token_ids: list[int] | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    dtype: type | None = None,
    return_logprob: bool = False,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    token_ids_logprob: list[int] | None = None,
    **unsupported: Any,
) -> Gen | Select:
    """Generate text into variable ``name``. With ``choices`` it is :func:`select`; ``dtype``
    (``int``, ``float``, ``bool``, ``str``) constrains the text with a regex and converts it;
    ``regex`` and ``json_schema`` are passed to the server's grammar backend. With
    ``return_logprob`` the variable's meta info has the logprobs, as SGLang's ``/generate``
    gives them (``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``; entries carry
    their token's text unless ``return_text_in_logprobs=False``)."""
    if unsupported:
        raise TypeError(f"gen() got unsupported argument(s): {', '.join(unsupported)}")
    if choices is not None:
        return Select(name, list(choices), temperature or 0.0, choices_method)
    if dtype not in (None, int, float, bool, str):
        raise ValueError(f"gen(dtype={dtype!r}): dtype must be int, float, bool or str")
    if json_schema is not None and not isinstance(json_schema, str):
        import json

        json_schema = json.dumps(json_schema)
    params = SamplingParams(max_new_tokens=max_tokens, min_new_tokens=min_tokens, stop=stop,
                            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            stop_token_ids=stop_token_ids, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, ignore_eos=ignore_eos,
                            regex=regex, json_schema=json_schema)
    logprobs: dict[str, Any] = {}
    if return_logprob:
        logprobs = {"return_logprob": True,
                    "return_text_in_logprobs": return_text_in_logprobs is not False}
        for key, value in (("logprob_start_len", logprob_start_len),
                           ("top_logprobs_num", top_logprobs_num),
                           ("token_ids_logprob", token_ids_logprob)):
            if value is not None:
                logprobs[key] = value
    return Gen(name, params, dtype, logprobs)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    return gen(name, max_tokens=max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    return gen(name, max_tokens=max_tokens, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesMethod | None = None) -> Select:
    """Choose one of ``choices`` by the log probability of its tokens after the prompt
    (``choices_method``: ``sgl.token_length_normalized`` by default,
    ``sgl.greedy_token_selection`` or ``sgl.unconditional_likelihood_normalized``)."""
    if not choices:
        raise ValueError("select() needs a non-empty list of choices")
    return Select(name, list(choices), temperature, choices_method)


def image(path: str) -> Image:
    """Accepted so that programs import; running it fails: the served models are text-only."""
    return Image(path)


def _role(role: str, expr: Any) -> ExprList:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
