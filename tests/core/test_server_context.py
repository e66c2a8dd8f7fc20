"""The name clients see in ``"model"`` fields (``ServerContext.model_name``)."""

from __future__ import annotations

import pytest

from sgl.config import ServerSettings
from sgl.engine.messages import SchedulerInfo
from sgl.server.context import ServerContext


def context(model_path: str, served_model_name: str | None = None) -> ServerContext:
    return ServerContext(settings=ServerSettings(served_model_name=served_model_name),
                         plugin_manager=None, scheduler=None,  # type: ignore[arg-type]
                         info=SchedulerInfo(ok=True, model_path=model_path),
                         tokenizer_manager=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("path", "served", "name"), [
    ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", None, "SmolLM2-135M-Instruct.Q4_1"),
    ("/models/smollm2-hf", None, "smollm2-hf"),
    ("/models/smollm2-hf/", None, "smollm2-hf"),
    ("/models/model.gguf", "my-model", "my-model"),
])
def test_the_model_name_is_the_served_name_else_the_file_or_folder(path: str, served: str | None,
                                                                  name: str) -> None:
    assert context(path, served).model_name == name


def test_the_model_name_is_worked_out_once() -> None:
    """Every streamed chunk carries the name: it is kept, not derived from the path per chunk."""
    ctx = context("/models/first.gguf")
    assert ctx.model_name == "first"
    ctx.info.model_path = "/models/second.gguf"
    assert ctx.model_name == "first"
