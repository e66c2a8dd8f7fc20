"""sgl-lang: SGLang's frontend language on sgl.

Programs written for SGLang run with only the import changed::

    import sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=32))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is the capital of France?")["answer"])
"""

from __future__ import annotations

from sgl_lang.api import (
    assistant, assistant_begin, assistant_end, gen, gen_int, gen_string, get_default_backend,
    image, select, set_default_backend, system, system_begin, system_end, user, user_begin,
    user_end,
)
from sgl_lang.backends import BaseBackend, EngineBackend, OpenAI, RuntimeEndpoint
from sgl_lang.choices import (
    greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized,
)
from sgl_lang.errors import BackendError, LangError
from sgl_lang.function import SglFunction, function
from sgl_lang.interpreter import ProgramState, ProgramStateGroup

__all__ = [
    "BackendError", "BaseBackend", "EngineBackend", "LangError", "OpenAI", "ProgramState",
    "ProgramStateGroup", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin",
    "assistant_end", "function", "gen", "gen_int", "gen_string", "get_default_backend",
    "greedy_token_selection", "image", "select", "set_default_backend", "system",
    "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
