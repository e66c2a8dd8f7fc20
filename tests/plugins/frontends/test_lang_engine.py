"""The frontend language on the in-process ``sgl.Engine`` (one small engine for the module):
the same programs give the same greedy text as on the server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import sgl
from sgl_testing import ServerProcess


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with sgl.Engine(max_total_tokens=2048, dtype="float32") as engine:  # as the server
        yield engine


@sgl.function
def quiz(s, question):
    s += sgl.system("You are a terse assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=10, temperature=0))
    s += sgl.user("Is that answer right?")
    s += sgl.assistant(sgl.select("verdict", ["Yes", "No"]))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nReason {i + 1}:"
        f += sgl.gen("reason", max_tokens=4, temperature=0)
    forks.join()


def test_engine_backend_matches_the_server(engine: Any, server: ServerProcess) -> None:
    backend = sgl.EngineBackend(engine)
    assert backend.chat_template.name == "chatml"  # detected from the model's own template
    on_engine = quiz.run(question="What is the capital of France?", backend=engine)
    assert on_engine["answer"]
    assert on_engine["verdict"] in ("Yes", "No")
    assert len(on_engine["reason"]) == 2 and all(on_engine["reason"])
    on_server = quiz.run(question="What is the capital of France?",
                         backend=sgl.RuntimeEndpoint(server.base_url))
    assert on_engine.text() == on_server.text()
    assert on_engine["reason"] == on_server["reason"]
    assert on_engine.get_meta_info("verdict")["normalized_prompt_logprobs"] == pytest.approx(
        on_server.get_meta_info("verdict")["normalized_prompt_logprobs"], abs=1e-3)


def test_engine_as_default_backend_streams_and_batches(engine: Any) -> None:
    sgl.set_default_backend(engine)
    try:
        assert isinstance(sgl.get_default_backend(), sgl.EngineBackend)
        state = quiz.run(question="What is 2 + 2?", stream=True)
        chunks = list(state.text_iter("answer"))
        assert len(chunks) > 1 and "".join(chunks) == state["answer"]
        states = quiz.run_batch([{"question": "What is 2 + 2?"}] * 3)
        assert len({s.text() for s in states}) == 1
        assert states[0]["answer"] == state["answer"]
    finally:
        sgl.set_default_backend(None)


def test_engine_refusal_is_a_backend_error(engine: Any) -> None:
    @sgl.function
    def bad(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2, top_p=5)

    with pytest.raises(sgl.BackendError, match="the engine refused the request: .*top_p"):
        bad.run(backend=engine)
