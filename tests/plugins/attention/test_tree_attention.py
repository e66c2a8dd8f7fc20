"""Token trees in one forward (the attention contract's ``tree_masks``, for verifying a
speculative draft tree): on a tiny random-weight Llama, every node's logits from one masked
forward over the tree equal those of running its root-to-node path as a plain causal extend;
and the bad trees and backends are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.engine.model_runner import ModelRunner
from sgl.forward_batch import ForwardMode
from sgl.plugins import create_plugin_manager
from sgl_testing import write_tiny_llama

PREFIX = [5, 9, 2, 77, 31, 8, 140, 6]
#: node tokens and parents: 0 is the root (the request's last token), 1 and 2 its children,
#: 3 a child of 1, 4 and 5 children of 3, 6 a child of 2
TOKENS = [11, 23, 42, 7, 99, 3, 250]
PARENTS = [-1, 0, 0, 1, 3, 3, 2]
#: a forest (a draft head's beams): three roots, each attending the prefix and its own subtree
FOREST = [-1, 0, -1, 2, -1, 4, 5]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tree"))
    pm = create_plugin_manager()
    return ModelRunner(model_path=str(path), dtype="float32", registries=pm.registries,
                       plugin_manager=pm, max_total_tokens=2048, max_running_requests=8,
                       show_progress=False)


def path_to(node: int, parents: list[int] = PARENTS) -> list[int]:
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]


def logits_of(runner: ModelRunner, seqs: list[BatchSeq]) -> torch.Tensor:
    batch = make_forward_batch(runner, ForwardMode.EXTEND, seqs)
    hidden = runner.forward(batch)
    return runner.logits_at(hidden, torch.arange(hidden.shape[0]))


def cached_prefix(runner: ModelRunner) -> int:
    row = runner.req_to_token_pool.alloc()
    logits_of(runner, [BatchSeq(row, 0, PREFIX)])
    return row


@pytest.mark.parametrize("with_prefix", [True, False])
@pytest.mark.parametrize("parents", [PARENTS, FOREST], ids=["tree", "forest"])
@pytest.mark.usefixtures("kernel_isa")  # sgl's extend kernel takes trees at every level
def test_one_tree_forward_equals_each_path(runner: ModelRunner, with_prefix: bool,
                                           parents: list[int]) -> None:
    with torch.inference_mode():
        free_before = runner.kv_pool.num_free
        prefix = PREFIX if with_prefix else []
        row = cached_prefix(runner) if with_prefix else runner.req_to_token_pool.alloc()
        # beside it in the same batch, a plain chain of another sequence
        other = runner.req_to_token_pool.alloc()
        tree = logits_of(runner, [BatchSeq(row, len(prefix), TOKENS, tree_parents=parents),
                                  BatchSeq(other, 0, [4, 8, 15, 16])])
        chain = logits_of(runner, [BatchSeq(other, 4, [23])])  # the chain's KV is right
        release_sequence(runner, row, len(prefix) + len(TOKENS))
        release_sequence(runner, other, 5)
        for node in range(len(TOKENS)):
            path = path_to(node, parents)
            r = runner.req_to_token_pool.alloc()
            alone = logits_of(runner, [BatchSeq(r, 0, prefix + [TOKENS[i] for i in path])])
            release_sequence(runner, r, len(prefix) + len(path))
            torch.testing.assert_close(tree[node], alone[-1], rtol=1e-4, atol=1e-4)
        r = runner.req_to_token_pool.alloc()
        want = logits_of(runner, [BatchSeq(r, 0, [4, 8, 15, 16, 23])])
        release_sequence(runner, r, 5)
        torch.testing.assert_close(chain[0], want[-1], rtol=1e-4, atol=1e-4)
        assert runner.kv_pool.num_free == free_before


def test_the_tree_really_masks(runner: ModelRunner) -> None:
    """Without the mask (a plain chain over the same tokens) a node sees its siblings: the
    logits differ, so the test above would catch a backend that ignored the tree."""
    with torch.inference_mode():
        row = runner.req_to_token_pool.alloc()
        tree = logits_of(runner, [BatchSeq(row, 0, TOKENS, tree_parents=PARENTS)])
        release_sequence(runner, row, len(TOKENS))
        row = runner.req_to_token_pool.alloc()
        chain = logits_of(runner, [BatchSeq(row, 0, TOKENS)])
        release_sequence(runner, row, len(TOKENS))
        assert not torch.allclose(tree[2], chain[2], atol=1e-3)  # node 2 is not after node 1


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, -2], [-1]])
def test_bad_trees_are_refused(runner: ModelRunner, parents: list[int]) -> None:
    row = runner.req_to_token_pool.alloc()
    try:
        free = runner.kv_pool.num_free
        with pytest.raises(ValueError, match="tree_parents"):
            make_forward_batch(runner, ForwardMode.EXTEND,
                               [BatchSeq(row, 0, [1, 2], tree_parents=parents)])
        assert runner.kv_pool.num_free == free
    finally:
        runner.req_to_token_pool.free(row)
