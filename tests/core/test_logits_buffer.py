"""``ModelRunner.logits_at(reuse=True)``: the scheduler's sampling takes each step's logits in
one kept buffer rather than a new tensor (a new one came from fresh pages and page faults), on
a tiny random-weight Llama saved by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.engine.model_runner import ModelRunner
from sgl.forward_batch import ForwardMode
from sgl.plugins import create_plugin_manager
from sgl_testing import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    pm = create_plugin_manager()
    return ModelRunner(model_path=str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))),
                       dtype="bfloat16", registries=pm.registries, plugin_manager=pm,
                       max_total_tokens=512, max_running_requests=4, show_progress=False)


def hidden_of(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    batch = make_forward_batch(runner, ForwardMode.EXTEND,
                               [BatchSeq(r, 0, p) for r, p in zip(rows, prompts)])
    return runner.forward(batch).clone()


def test_reused_logits_are_the_logits_in_one_buffer(runner: ModelRunner) -> None:
    hidden = hidden_of(runner, [[5, 9, 2, 7], [1, 3], [8] * 6])
    picks = [torch.tensor([0, 5, 11]), torch.tensor([3]), torch.arange(12)]
    pointers = set()
    for rows in picks:  # 12 rows: more than max_running_requests, so the buffer grows
        fresh = runner.logits_at(hidden, rows)
        reused = runner.logits_at(hidden, rows, reuse=True)
        assert reused.dtype == torch.float32 and reused.shape == fresh.shape
        assert torch.equal(reused, fresh)
        assert reused.data_ptr() != fresh.data_ptr()
        pointers.add(reused.data_ptr())
    again = runner.logits_at(hidden, picks[0], reuse=True)
    assert again.data_ptr() in pointers and len(pointers) == 2  # the grown buffer is kept
    # without reuse, every call returns a tensor of its own, and the head is left as it was
    assert runner.logits_at(hidden, picks[0]).data_ptr() != again.data_ptr()
    assert runner.model.get_output_embeddings().logits_scratch is None
