"""Replaying recorded decode forwards (``sgl_kernels_cpu.graphs``) against the model's own code,
on a tiny random-weight Llama saved by transformers, at each kernel level of the CPU."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl_kernels_cpu.graphs import split_parts
from sgl.engine.setup import record_decode_forwards
from sgl.forward_batch import ForwardMode
from sgl.engine.model_runner import ModelRunner
from sgl.kernels import cpu
from sgl.plugins import create_plugin_manager
from sgl_testing import write_tiny_llama

# at every kernel level this CPU has (replays need sgl's kernels), with torch on one thread as
# the scheduler runs it on 2 cores: sgl's matmul kernels need it
pytestmark = pytest.mark.usefixtures("kernel_isa", "one_torch_thread")

PROMPTS = [[5, 9, 2], [7] * 9, [1], list(range(3, 20)), [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_runner(path: Path, dtype: str, **kwargs: Any) -> ModelRunner:
    pm = create_plugin_manager()
    kwargs.setdefault("max_running_requests", 8)
    return ModelRunner(model_path=str(path), dtype=dtype, registries=pm.registries,
                       plugin_manager=pm, max_total_tokens=2048, show_progress=False, **kwargs)


class Sequences:
    """Greedy decoding of ``prompts`` on ``runner``, one forward at a time."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        batch = make_forward_batch(runner, ForwardMode.EXTEND,
                                   [BatchSeq(r, 0, p) for r, p in zip(self.rows, prompts)])
        self.lengths = [len(p) for p in prompts]
        self.next = self.pick(runner.forward(batch), batch)

    def pick(self, hidden: torch.Tensor, batch: Any) -> list[int]:
        last = torch.cumsum(batch.extend_seq_lens, dim=0) - 1
        return self.runner.logits_at(hidden, last).argmax(-1).tolist()

    def decode_batch(self) -> Any:
        batch = make_forward_batch(self.runner, ForwardMode.DECODE, [
            BatchSeq(r, n, [t]) for r, n, t in zip(self.rows, self.lengths, self.next)])
        self.lengths = [n + 1 for n in self.lengths]
        return batch


def eager_then_graph(runner: ModelRunner, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The same decode batch run by the model's code and then through the graph runner (the
    second pass writes the same K/V into the same slots)."""
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        eager = runner.forward(batch).clone()
    finally:
        runner.decode_graphs = graphs
    return eager, runner.forward(batch)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_replay_equals_the_model_code(model_dir: Path, dtype: str,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sgl")
    runner = make_runner(model_dir, dtype)
    graphs = runner.decode_graphs
    assert graphs is not None
    seqs = Sequences(runner, PROMPTS)
    first = None
    for step in range(6):
        batch = seqs.decode_batch()
        if first is None:
            first = batch
            kept = {name: getattr(batch, name).clone() for name in (
                "input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")}
        eager, replayed = eager_then_graph(runner, batch)
        assert torch.equal(replayed, eager), f"step {step}"
        seqs.next = seqs.pick(replayed, batch)
    # step 0 eager (a size seen once is not recorded), step 1 recorded, then replays
    assert (graphs.captures, graphs.replays) == (1, 4)
    assert "decode graphs on" in caplog.text
    assert "recorded the decode forward of batch size 5" in caplog.text
    assert 0 < graphs.nbytes < 2**20
    # the recording ran on copies: the batch it was recorded from is not overwritten by replays
    for name, value in kept.items():
        assert torch.equal(getattr(first, name), value), name


def test_batches_split_in_parts_with_two_kernel_threads() -> None:
    assert [split_parts(size, 2) for size in (1, 8, 15, 16, 17, 64)] == [1, 1, 1, 2, 2, 2]
    assert [split_parts(size, threads) for size, threads in ((64, 1), (64, 3), (256, 4))] \
        == [1, 1, 1]


@pytest.mark.usefixtures("restore_kernel_threads")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_large_batch_replays_in_two_parts(model_dir: Path, dtype: str) -> None:
    """With two kernel threads a batch of 17 is recorded as parts of 8 and 9 sequences, replayed
    at once, one thread each: its hidden states are the model code's, bit for bit; with one
    kernel thread the same batch is one part."""
    assert cpu.set_threads(2) == 2
    runner = make_runner(model_dir, dtype, max_running_requests=20)
    graphs = runner.decode_graphs
    assert graphs is not None
    prompts = [[(7 * i + j) % 50 + 1 for j in range(1 + i % 5)] for i in range(17)]
    seqs = Sequences(runner, prompts)
    for step in range(5):
        batch = seqs.decode_batch()
        eager, replayed = eager_then_graph(runner, batch)
        assert torch.equal(replayed, eager), f"step {step}"
        seqs.next = seqs.pick(replayed, batch)
    assert (graphs.captures, graphs.replays) == (1, 3)
    graph = graphs.graphs[(17, 2, 1)]
    assert graph is not None
    assert [(part.start, part.end) for part in graph.parts] == [(0, 8), (8, 17)]
    assert all(len(part.tape) == len(graph.parts[0].tape) for part in graph.parts)
    cpu.set_threads(1)
    for step in range(3):
        batch = seqs.decode_batch()
        eager, replayed = eager_then_graph(runner, batch)
        assert torch.equal(replayed, eager), f"one thread, step {step}"
        seqs.next = seqs.pick(replayed, batch)
    assert len(graphs.graphs[(17, 1, 1)].parts) == 1


def test_batch_sizes_are_recorded_separately_and_evicted(model_dir: Path) -> None:
    runner = make_runner(model_dir, "bfloat16")
    graphs = runner.decode_graphs
    assert graphs is not None
    runs = {size: Sequences(runner, PROMPTS[:size]) for size in (1, 2, 3)}

    def step(size: int) -> None:
        eager, replayed = eager_then_graph(runner, runs[size].decode_batch())
        assert torch.equal(replayed, eager)

    for size in (1, 1, 2, 2):  # seen, recorded; seen, recorded
        step(size)
    assert [key[0] for key in graphs.graphs] == [1, 2]
    # the activations grow with the batch (r per sequence: 1 r and 2 r so far); room for 5 r
    # keeps sizes 1 and 3 but not 1, 2 and 3
    sizes = {key[0]: g.nbytes for key, g in graphs.graphs.items() if g is not None}
    assert sizes[2] == 2 * sizes[1]
    graphs.max_bytes = 5 * sizes[1]
    for size in (1, 3, 3):  # 1 replayed; 3 seen, recorded, and 2 dropped
        step(size)
    assert [key[0] for key in graphs.graphs] == [1, 3]
    assert (graphs.captures, graphs.replays) == (3, 1)
    graphs.max_bytes = 1  # a graph larger than the budget is not kept
    graphs.clear()
    for size in (2, 2, 2):
        step(size)
    assert list(graphs.graphs.values()) == [None] and graphs.replays == 1


def test_forward_with_torch_compute_is_not_recorded(model_dir: Path) -> None:
    """float32 below F32_MIN_ROWS rows on one kernel thread goes through torch's matmul
    (sgl_kernels_cpu.linear): that batch size stays eager (and right). The kernel threads are
    pinned to one here, whatever an earlier test in this process left them at."""
    from sgl_kernels_cpu.linear import F32_MIN_ROWS

    before = cpu.kernel_threads()
    cpu.set_threads(1)
    try:
        runner = make_runner(model_dir, "float32")
        graphs = runner.decode_graphs
        assert graphs is not None
        small = Sequences(runner, PROMPTS[:F32_MIN_ROWS - 1])
        for _ in range(3):
            eager, replayed = eager_then_graph(runner, small.decode_batch())
            assert torch.equal(replayed, eager)
        assert list(graphs.graphs.values()) == [None]
        assert (graphs.captures, graphs.replays) == (0, 0)
    finally:
        cpu.set_threads(before)


def test_cpu_graphs_can_be_turned_off(model_dir: Path) -> None:
    assert make_runner(model_dir, "bfloat16", cpu_graphs=False).decode_graphs is None


def test_scheduler_passes_the_setting(tmp_path: Path) -> None:
    """--disable-cpu-graph turns the replays off; --cpu-graph-max-bs N records sizes 1 to N
    before serving (0: none), by default up to --max-running-requests or 64."""
    from test_scheduler import Harness  # same folder

    for disable, max_bs, recorded in ((True, 2, None), (False, 3, [1, 2, 3]), (False, 0, [])):
        folder = tmp_path / f"{disable}-{max_bs}"
        folder.mkdir()
        harness = Harness(folder, disable_cpu_graph=disable, cpu_graph_max_bs=max_bs)
        try:
            scheduler = harness.scheduler
            graphs = scheduler.runner.decode_graphs
            assert (graphs is None) is disable
            if graphs is None:
                continue
            assert sorted(key[0] for key in graphs.graphs) == recorded
            assert (graphs.arena is None) is (not recorded)
            if recorded:
                continue
            scheduler.settings = dataclasses.replace(scheduler.settings, cpu_graph_max_bs=None,
                                                     max_running_requests=3)
            assert record_decode_forwards(scheduler.runner, scheduler.settings) == [3, 2, 1]
            asked: list[int] = []  # the largest size asked for (recording 64 takes seconds)
            graphs.record_batch_sizes = lambda max_bs, **_: asked.append(max_bs) or []
            for max_bs, running in ((None, 80), (100, 80), (100, 120)):
                scheduler.settings = dataclasses.replace(
                    scheduler.settings, cpu_graph_max_bs=max_bs, max_running_requests=running)
                record_decode_forwards(scheduler.runner, scheduler.settings)
            assert asked == [64, 80, 100]
        finally:
            harness.close()


@pytest.mark.usefixtures("restore_kernel_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_sizes_recorded_at_start_up_share_one_arena(model_dir: Path, threads: int,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """record_batch_sizes records every size from the largest down, their activations in one
    arena the size of the largest's: batches of those sizes, in any order, replay the model
    code's hidden states bit for bit (each replay overwrites what the one before left in the
    arena), and no size is recorded again while serving."""
    caplog.set_level(logging.INFO, logger="sgl")
    assert cpu.set_threads(threads) == threads
    runner = make_runner(model_dir, "bfloat16", max_running_requests=64)
    graphs = runner.decode_graphs
    assert graphs is not None
    assert graphs.record_batch_sizes(20, show_progress=False) == list(range(20, 0, -1))
    assert "recorded the decode forwards of 20 batch sizes (1 to 20)" in caplog.text
    assert sorted(key[0] for key in graphs.graphs) == list(range(1, 21))
    arena = graphs.arena
    assert arena is not None
    storage = arena.untyped_storage().data_ptr()
    for graph in graphs.graphs.values():
        assert graph is not None
        for part in graph.parts:
            assert part.tape.outputs and all(
                t.untyped_storage().data_ptr() == storage for t in part.tape.outputs)
    largest = graphs.graphs[(20, threads, 1)]
    assert len(largest.parts) == split_parts(20, threads)
    assert largest.arena_bytes <= arena.numel()
    # the arena is the largest graph's activations, not the sum of all twenty
    assert arena.numel() < 2 * largest.arena_bytes
    assert graphs.nbytes < arena.numel() + 20 * 2**16
    captures = graphs.captures
    prompts = [[(5 * i + j) % 50 + 1 for j in range(1 + i % 6)] for i in range(20)]
    runs = {size: Sequences(runner, prompts[:size]) for size in (20, 17, 9, 3, 1)}
    for round_, size in enumerate((20, 3, 17, 1, 9, 20, 9, 3, 17, 1)):
        replays = graphs.replays
        batch = runs[size].decode_batch()
        eager, replayed = eager_then_graph(runner, batch)
        assert torch.equal(replayed, eager), f"round {round_}, batch of {size}"
        assert graphs.replays == replays + 1
        runs[size].next = runs[size].pick(replayed, batch)
    assert graphs.captures == captures


def test_the_arena_is_held_to_the_graphs_memory(model_dir: Path) -> None:
    """Where the largest batch's activations would pass half of max_bytes, the sizes recorded at
    start-up stop at the largest batch whose activations fit in that half, the arena too; a
    larger batch is still recorded when it recurs, its activations beyond the arena on their
    own, in the other half."""
    runner = make_runner(model_dir, "bfloat16", max_running_requests=64)
    graphs = runner.decode_graphs
    assert graphs is not None
    graphs.record_batch_sizes(16, show_progress=False)
    needed = graphs.arena.numel()
    small = make_runner(model_dir, "bfloat16", max_running_requests=64)
    graphs = small.decode_graphs
    graphs.max_bytes = needed
    recorded = graphs.record_batch_sizes(16, show_progress=False)
    assert recorded == list(range(recorded[0], 0, -1)) and 6 <= recorded[0] <= 8
    assert graphs.arena.numel() <= needed // 2
    seqs = Sequences(small, [[(3 * i + 1) % 50 + 1, i + 2] for i in range(12)])
    for step in range(3):  # seen, recorded (in part beyond the arena), replayed
        batch = seqs.decode_batch()
        eager, replayed = eager_then_graph(small, batch)
        assert torch.equal(replayed, eager), f"step {step}"
        seqs.next = seqs.pick(replayed, batch)
    graph = graphs.graphs[(12, cpu.kernel_threads(), 1)]
    assert graph is not None and graph.nbytes > 0
    assert graphs.replays == 1
