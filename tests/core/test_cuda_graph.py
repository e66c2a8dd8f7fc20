"""CUDA graphs for decode (``sgl.engine.cuda_graph``) on CPU, against the model's own code.

There is no CUDA here, so these tests put a stand-in in place of the one piece that cannot
exist without it, :func:`sgl.engine.cuda_graph._capture`: the stand-in keeps the captured
callable (a forward of the padding batch over the runner's static tensors) and runs it again on
each replay. A real graph replays the same kernels on the same tensors, so a replay reads what
the runner copied into them: padding, the copies of the batch's and the attention backend's
tensors, and slicing the output are what these tests check. Capturing itself (that the model's
and the backend's kernels are capturable at all) needs a GPU: ``test_capture_on_cuda``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl.engine import cuda_graph
from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.engine.cuda_graph import CudaGraphRunner, CudaGraphUnsupported, capture_batch_sizes
from sgl.engine.model_runner import ModelRunner
from sgl.forward_batch import ForwardBatch, ForwardMode
from sgl.plugins import create_plugin_manager
from sgl_testing import write_tiny_llama

MAX_BS = 10  # graphs of 1, 2, 4, 8 and 10 rows
PROMPTS = [[5, 9, 2], [7] * 9, [1], list(range(3, 20)), [11, 12, 13, 14, 15], [4, 4],
           [8, 1, 8, 1], [2] * 6, [30, 31], [99] * 3, [6, 7, 8]]  # MAX_BS + 1 sequences


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def stand_in_capture(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``_capture`` replaced by a callable that runs the captured forward again on replay;
    the value lists the batch sizes captured, in order."""
    captured: list[int] = []

    def capture(fn: Callable[[], Any], pool: Any) -> Callable[[], Any]:
        assert pool is None  # no CUDA memory pool on CPU
        hidden, _ = fn()
        captured.append(int(hidden.shape[0]))
        return fn

    monkeypatch.setattr(cuda_graph, "_capture", capture)
    return captured


def make_runner(path: Path, dtype: str) -> ModelRunner:
    pm = create_plugin_manager()
    return ModelRunner(model_path=str(path), dtype=dtype, registries=pm.registries,
                       plugin_manager=pm, max_total_tokens=2048,
                       max_running_requests=len(PROMPTS), show_progress=False,
                       cpu_graphs=False)


def make_graphs(runner: ModelRunner, max_bs: int = MAX_BS) -> CudaGraphRunner:
    return CudaGraphRunner(runner.model, runner.attn_backend, kv_pool=runner.kv_pool,
                           req_to_token_pool=runner.req_to_token_pool, max_bs=max_bs,
                           device=runner.device, show_progress=False)


class Sequences:
    """The prompts prefilled on ``runner``; decode batches of any of them, one at a time."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        batch = make_forward_batch(runner, ForwardMode.EXTEND,
                                   [BatchSeq(r, 0, p) for r, p in zip(self.rows, prompts)])
        self.lengths = [len(p) for p in prompts]
        last = torch.cumsum(batch.extend_seq_lens, dim=0) - 1
        self.next = runner.logits_at(runner.forward(batch), last).argmax(-1).tolist()

    def decode_batch(self, which: list[int]) -> ForwardBatch:
        """A decode batch of sequences ``which``; their next tokens are set by :meth:`done`."""
        return make_forward_batch(self.runner, ForwardMode.DECODE, [
            BatchSeq(self.rows[i], self.lengths[i], [self.next[i]]) for i in which])

    def done(self, which: list[int], hidden: torch.Tensor) -> None:
        picked = self.runner.logits_at(hidden, torch.arange(len(which))).argmax(-1).tolist()
        for i, token in zip(which, picked):
            self.lengths[i] += 1
            self.next[i] = token


def kv_state(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for t in (*runner.kv_pool.k_buffer, *runner.kv_pool.v_buffer)]


def restore_kv(runner: ModelRunner, state: list[torch.Tensor]) -> None:
    for tensor, saved in zip((*runner.kv_pool.k_buffer, *runner.kv_pool.v_buffer), state):
        tensor.copy_(saved)


def eager_and_graph(runner: ModelRunner, graphs: CudaGraphRunner, batch: ForwardBatch) -> tuple[
        torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The batch run by the model's code and then by the graph runner from the same KV pool:
    both hidden states, and the pool before, after the eager run and after the replay."""
    before = kv_state(runner)
    eager = runner.forward(batch).clone()
    after_eager = kv_state(runner)
    restore_kv(runner, before)
    replayed = graphs.forward(batch)
    return eager, replayed, before, after_eager, kv_state(runner)


@pytest.mark.parametrize(("max_bs", "sizes"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (10, [1, 2, 4, 8, 10]),
    (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32]),
])
def test_capture_batch_sizes(max_bs: int, sizes: list[int]) -> None:
    assert capture_batch_sizes(max_bs) == sizes


def test_capture_batch_sizes_needs_a_positive_size() -> None:
    with pytest.raises(ValueError, match="at least 1, got 0"):
        capture_batch_sizes(0)


@pytest.mark.usefixtures("kernel_isa", "one_torch_thread")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_replay_equals_the_model_code(model_dir: Path, dtype: str, stand_in_capture: list[int],
                                      caplog: pytest.LogCaptureFixture) -> None:
    """Decode batches of 1, 3, 5 and 8 rows (3 and 5 padded to 4 and 8) through the graphs:
    the hidden states and the KV the real rows write are the model code's, bit for bit (the
    kernels compute each row on its own, whatever the rows around it); padding rows write slot
    0 and nothing else.

    One exception: in float32 a matmul of fewer than ``F32_MIN_ROWS`` (4) rows runs torch's
    matmul and one of 4 or more sgl's kernel, which sums in another order, so 3 rows padded to
    4 differ from the eager 3 by float32 rounding (measured: 7e-7 on values up to 3); there
    they are compared within 1e-5."""
    from sgl_kernels_cpu.linear import F32_MIN_ROWS
    caplog.set_level(logging.INFO, logger="sgl")
    runner = make_runner(model_dir, dtype)
    assert not any(t[0].any() for t in runner.kv_pool.k_buffer)  # slot 0 untouched so far
    seqs = Sequences(runner, PROMPTS)
    graphs = make_graphs(runner)
    first = seqs.decode_batch([0])
    assert graphs.graphs == {} and not graphs.can_run(first)  # nothing captured yet
    graphs.capture()
    assert stand_in_capture == [10, 8, 4, 2, 1]  # largest first
    assert "captured CUDA graphs of decode batch sizes 1, 2, 4, 8, 10" in caplog.text
    assert all(t[0].any() for t in runner.kv_pool.k_buffer)  # the padding rows wrote slot 0
    for step, which in enumerate([[0], [1, 2, 3], [4, 0, 5, 6, 7], list(range(8)), [3, 9, 10]]):
        batch = first if step == 0 else seqs.decode_batch(which)
        assert graphs.can_run(batch)
        eager, replayed, before, after_eager, after_graph = eager_and_graph(runner, graphs, batch)
        assert replayed.shape == eager.shape == (len(which), 64)
        padded = min(size for size in graphs.graphs if size >= len(which))
        exact = dtype == "bfloat16" or padded == len(which) or len(which) >= F32_MIN_ROWS

        def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
            if exact:
                assert torch.equal(a, b), what
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)

        same(replayed, eager, f"step {step}: rows {which}")
        real = batch.out_cache_loc
        others = torch.ones(runner.kv_pool.size + 1, dtype=torch.bool)
        others[real] = False
        others[0] = False
        for layer, (b, e, g) in enumerate(zip(before, after_eager, after_graph)):
            same(g[real], e[real], f"step {step}, buffer {layer}: real slots")
            assert torch.equal(g[others], b[others]), f"step {step}, buffer {layer}: others"
        seqs.done(which, replayed)
    assert graphs.replays == 5
    too_many = seqs.decode_batch(list(range(MAX_BS + 1)))
    assert not graphs.can_run(too_many)
    with pytest.raises(ValueError, match="decode batches of 1 to 10 sequences"):
        graphs.forward(too_many)
    extend = make_forward_batch(runner, ForwardMode.EXTEND, [BatchSeq(seqs.rows[0], 30, [1, 2])])
    assert not graphs.can_run(extend)


def own_copies(runner: ModelRunner, listed: tuple[int, ...]) -> None:
    """Make the torch backend plan as GPU backends do: its decode kernel reads copies of the
    batch's rows, lengths and slots made by ``init_forward_metadata`` (not the batch's own
    tensors); ``graph_inputs`` lists those of the copies at ``listed``."""
    backend = runner.attn_backend
    plan_for = backend.init_forward_metadata

    def init_forward_metadata(batch: ForwardBatch) -> None:
        plan_for(batch)
        native = batch.attn_metadata.native
        if batch.mode == ForwardMode.DECODE and native is not None:
            batch.attn_metadata.native = dataclasses.replace(
                native, rows=native.rows.clone(), lens=native.lens.clone(),
                loc=native.loc.clone())

    def graph_inputs(batch: ForwardBatch) -> list[torch.Tensor]:
        native = batch.attn_metadata.native
        return [(native.rows, native.lens, native.loc)[i] for i in listed]

    backend.init_forward_metadata = init_forward_metadata  # type: ignore[method-assign]
    backend.graph_inputs = graph_inputs  # type: ignore[method-assign]


@pytest.mark.usefixtures("kernel_isa", "one_torch_thread", "stand_in_capture")
@pytest.mark.parametrize("listed", [(0, 1, 2), (0, 2)], ids=["all-listed", "lens-not-listed"])
def test_the_backends_graph_inputs_are_copied(model_dir: Path, listed: tuple[int, ...]) -> None:
    """With a backend whose kernels read its own copies of the batch's tensors, replays equal
    the model code only when ``graph_inputs`` lists all of them: without the lengths the graph
    attends with the lengths it was captured with (1), and the comparison fails."""
    runner = make_runner(model_dir, "bfloat16")
    own_copies(runner, listed)
    graphs = make_graphs(runner, max_bs=4)
    graphs.capture()
    seqs = Sequences(runner, PROMPTS[:4])
    which = [0, 1, 2]  # padded to 4
    eager, replayed, *_ = eager_and_graph(runner, graphs, seqs.decode_batch(which))
    assert torch.equal(replayed, eager) is (listed == (0, 1, 2))


@pytest.mark.usefixtures("kernel_isa", "one_torch_thread", "stand_in_capture")
def test_graph_inputs_must_keep_their_shapes(model_dir: Path) -> None:
    """A graph input whose shape depends on more than the batch size is refused at replay."""
    runner = make_runner(model_dir, "bfloat16")
    backend = runner.attn_backend
    listed = backend.graph_inputs
    backend.graph_inputs = lambda batch: [*listed(batch),  # type: ignore[method-assign]
                                          torch.zeros(int(batch.seq_lens.sum()))]
    graphs = make_graphs(runner, max_bs=2)
    graphs.capture()
    seqs = Sequences(runner, PROMPTS[:1])
    with pytest.raises(RuntimeError, match=r"graph input 3 of the torch attention backend is "
                       r"torch.float32 \(4,\) for a decode batch of 1 rows, torch.float32 "
                       r"\(1,\) when captured"):
        graphs.forward(seqs.decode_batch([0]))


@pytest.mark.usefixtures("stand_in_capture")
def test_backend_without_graph_inputs_is_refused(model_dir: Path) -> None:
    """The torch backend lists no graph inputs without sgl's CPU kernels (nor on a GPU)."""
    runner = make_runner(model_dir, "float32")
    runner.attn_backend.graph_inputs = lambda batch: None  # type: ignore[method-assign]
    graphs = make_graphs(runner, max_bs=2)
    with pytest.raises(CudaGraphUnsupported, match="the torch attention backend on cpu lists "
                       "no graph_inputs for a decode batch, so its decode forward cannot be "
                       "captured into a CUDA graph; run with --disable-cuda-graph"):
        graphs.capture()
    assert graphs.graphs == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_capture_without_cuda_is_refused() -> None:
    with pytest.raises(CudaGraphUnsupported, match="CUDA graphs need a CUDA device"):
        cuda_graph._capture(lambda: torch.zeros(1), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_on_cuda() -> None:
    """The real seam: a replay reruns the captured kernels on the tensors' new values and
    returns the captured output tensor; two graphs share one memory pool."""
    x = torch.zeros(4, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    twice = (lambda: x * 2 + 1)
    twice()  # warm-up
    torch.cuda.synchronize()
    first = cuda_graph._capture(twice, pool)
    second = cuda_graph._capture(lambda: x - 1, pool)
    x.fill_(3)
    out = first()
    assert out is first() and out.tolist() == [7.0] * 4
    assert second().tolist() == [2.0] * 4


def test_padding_rows() -> None:
    """Padding appends token 0 at position 0 of request row 0, one token long, written at slot
    0, to the tensors and to the host lists the batch fills; the caller's batch is unchanged."""
    def ints(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=ints(17, 18), positions=ints(4, 9),
        req_pool_indices=ints(2, 3), seq_lens=ints(5, 10), extend_prefix_lens=ints(4, 9),
        extend_seq_lens=ints(1, 1), out_cache_loc=ints(40, 41), req_to_token_pool=None,
        kv_pool=None, attn_backend=None, seq_lens_cpu=[5, 10], extend_prefix_lens_cpu=[4, 9],
        extend_seq_lens_cpu=[1, 1], attn_metadata="planned")
    padded = cuda_graph._pad(batch, 4)
    assert padded.input_ids.tolist() == [17, 18, 0, 0]
    assert padded.positions.tolist() == [4, 9, 0, 0]
    assert padded.req_pool_indices.tolist() == [2, 3, 0, 0]
    assert padded.seq_lens.tolist() == padded.seq_lens_cpu == [5, 10, 1, 1]
    assert padded.extend_prefix_lens.tolist() == padded.extend_prefix_lens_cpu == [4, 9, 0, 0]
    assert padded.extend_seq_lens.tolist() == padded.extend_seq_lens_cpu == [1, 1, 1, 1]
    assert padded.out_cache_loc.tolist() == [40, 41, 0, 0]
    assert padded.batch_size == 4 and padded.attn_metadata is None
    assert batch.batch_size == 2 and batch.input_ids.tolist() == [17, 18]
    assert batch.attn_metadata == "planned"


@pytest.mark.usefixtures("kernel_isa", "one_torch_thread")
def test_a_failed_capture_is_refused(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What CUDA reports when a forward cannot be captured (here, the message a host
    synchronisation gets) comes back as CudaGraphUnsupported naming the batch size and the
    ways out; no graph is kept."""
    calls: list[int] = []

    def capture(fn: Callable[[], Any], pool: Any) -> Callable[[], Any]:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return fn

    monkeypatch.setattr(cuda_graph, "_capture", capture)
    graphs = make_graphs(make_runner(model_dir, "bfloat16"), max_bs=4)
    with pytest.raises(CudaGraphUnsupported, match=r"capturing the decode forward of batch "
                       r"size 2 into a CUDA graph failed: CUDA error: operation not permitted "
                       r"when stream is capturing\. .* lower --cuda-graph-max-bs or run with "
                       r"--disable-cuda-graph"):
        graphs.capture()
    assert graphs.graphs == {}
