"""The ``torch`` attention backend against a naive per-sequence reference, on ragged batches
that go extend -> extend on a cached prefix -> decode."""

from __future__ import annotations

from types import SimpleNamespace
import pytest
import torch

import sgl_attn_torch.backend as backend_module
from sgl.attention import AttentionLayerSpec
from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.forward_batch import ForwardMode
from sgl.kvcache import KVPool, ReqToTokenPool
from sgl.plugins import create_plugin_manager
from sgl_attn_torch.backend import TorchAttentionBackend

HEAD_DIM = 8


def test_plugin_is_installed() -> None:
    pm = create_plugin_manager()
    assert pm.records["attn-torch"].available
    assert "sgl_register_attention_backends" in pm.records["attn-torch"].hooks
    entry = pm.registries.attention.entry("torch")
    assert entry.owner == "attn-torch" and entry.load() is TorchAttentionBackend


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
              spec: AttentionLayerSpec) -> torch.Tensor:
    """Attention of queries at ``positions`` over the whole sequence's keys, in float64."""
    group = spec.num_heads // spec.num_kv_heads
    q = q.view(len(positions), spec.num_heads, spec.head_dim).double()
    k = k.view(-1, spec.num_kv_heads, spec.head_dim).double().repeat_interleave(group, dim=1)
    v = v.view(-1, spec.num_kv_heads, spec.head_dim).double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scaling
    if spec.logit_softcap is not None:
        scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    q_pos = torch.tensor(positions).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    visible = k_pos <= q_pos
    if spec.sliding_window is not None:
        visible &= q_pos - k_pos < spec.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.reshape(len(positions), -1).float()


class Harness:
    """Pools, backend and the full per-sequence q/k/v the test feeds in piece by piece."""

    def __init__(self, spec: AttentionLayerSpec, lengths: list[int],
                 dtype: torch.dtype = torch.float32) -> None:
        device = torch.device("cpu")
        self.spec = spec
        self.dtype = dtype
        self.kv_pool = KVPool(size=512, num_layers=spec.layer_id + 1,
                              num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                              dtype=dtype, device=device)
        self.req_pool = ReqToTokenPool(max_requests=8, max_context_len=256, device=device)
        self.backend = TorchAttentionBackend(kv_pool=self.kv_pool,
                                             req_to_token_pool=self.req_pool, device=device)
        self.runner = SimpleNamespace(device=device, kv_pool=self.kv_pool,
                                      req_to_token_pool=self.req_pool, attn_backend=self.backend)
        self.rows = [self.req_pool.alloc() for _ in lengths]
        self.full = [{name: torch.randn(n, heads * spec.head_dim).to(dtype) for name, heads in
                      (("q", spec.num_heads), ("k", spec.num_kv_heads), ("v", spec.num_kv_heads))}
                     for n in lengths]
        self.done = [0] * len(lengths)

    def step(self, mode: ForwardMode, new: list[int], decode_seqs: int | None = None) -> None:
        seqs = [BatchSeq(row, self.done[i], [0] * n) for i, (row, n) in
                enumerate(zip(self.rows, new)) if n]
        index = [i for i, n in enumerate(new) if n]
        assert all(self.done[i] + new[i] <= len(self.full[i]["q"]) for i in index)
        batch = make_forward_batch(self.runner, mode, seqs, decode_seqs=decode_seqs)
        parts = {name: torch.cat([self.full[i][name][self.done[i]:self.done[i] + new[i]]
                                  for i in index]) for name in "qkv"}
        self.backend.init_forward_metadata(batch)
        out = self.backend.forward(parts["q"], parts["k"], parts["v"], self.spec, batch)
        start = 0
        for i in index:
            end = self.done[i] + new[i]
            expected = reference(self.full[i]["q"][self.done[i]:end], self.full[i]["k"][:end],
                                 self.full[i]["v"][:end], list(range(self.done[i], end)),
                                 self.spec)
            tol = (1e-4, 1e-5) if self.dtype == torch.float32 else (0.02, 0.02)
            torch.testing.assert_close(out[start:start + new[i]].float(), expected, rtol=tol[0],
                                       atol=tol[1])
            start += new[i]
            self.done[i] = end


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (4, 3.0)],
                         ids=["full", "window", "softcap", "window+softcap"])
def test_extend_prefix_then_decode(heads: tuple[int, int], window: int | None,
                                   softcap: float | None) -> None:
    torch.manual_seed(0)
    spec = AttentionLayerSpec(layer_id=1, num_heads=heads[0], num_kv_heads=heads[1],
                              head_dim=HEAD_DIM, scaling=HEAD_DIM ** -0.5,
                              sliding_window=window, logit_softcap=softcap)
    harness = Harness(spec, lengths=[12, 20, 6, 10])
    harness.step(ForwardMode.EXTEND, [5, 13, 1, 0])  # ragged, one sequence not yet started
    harness.step(ForwardMode.EXTEND, [3, 4, 2, 7])  # on cached prefixes, plus a fresh one
    for _ in range(3):
        harness.step(ForwardMode.DECODE, [1, 1, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (4, 3.0)],
                         ids=["full", "window", "softcap", "window+softcap"])
def test_decode_head_dim_64(dtype: torch.dtype, heads: tuple[int, int], window: int | None,
                            softcap: float | None, cpu_isa: str) -> None:
    """Decode at a real head size in both KV dtypes at each instruction-set level of the CPU:
    through sgl's CPU kernel at the kernel levels (with bfloat16 dot products where the level
    has them), through torch below them."""
    from sgl.kernels import cpu

    assert (cpu.load() is not None) == (cpu_isa in cpu.kernel_levels())
    torch.manual_seed(2)
    spec = AttentionLayerSpec(layer_id=0, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                              scaling=0.125, sliding_window=window, logit_softcap=softcap)
    harness = Harness(spec, lengths=[40, 9, 23, 150], dtype=dtype)  # 150: V in several passes
    with cpu.recording() as tape:
        harness.step(ForwardMode.EXTEND, [30, 1, 20, 140])
    kernels = cpu.load()  # the prefill kernel where it beats SDPA, else SDPA (see cpu.py)
    assert any(name.startswith("sgl_extend_attention") for name in tape.names) == (
        kernels is not None and kernels.extend_attention_faster(dtype))
    for _ in range(3):
        harness.step(ForwardMode.DECODE, [1, 1, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (4, 3.0)],
                         ids=["full", "window", "window+softcap"])
def test_mixed_step_attends_its_decodes_with_the_decode_kernel(
        dtype: torch.dtype, window: int | None, softcap: float | None, cpu_isa: str) -> None:
    """A mixed step (the running requests' one new token each, then prompt chunks) gives its
    decode rows (``decode_seqs``, leading one-token sequences) to the decode kernel and the rest
    to the extend kernel: a one-token sequence after a longer one, or a prompt's lone last
    token (one new token on a cached prefix, not a decode row), stays in the extend call."""
    from sgl.kernels import cpu

    torch.manual_seed(4)
    spec = AttentionLayerSpec(layer_id=0, num_heads=9, num_kv_heads=3, head_dim=64,
                              scaling=0.125, sliding_window=window, logit_softcap=softcap)
    harness = Harness(spec, lengths=[40, 9, 26, 30, 14], dtype=dtype)
    harness.step(ForwardMode.EXTEND, [30, 1, 20, 10, 0])
    kernels = cpu.load()
    native = kernels is not None and kernels.extend_attention_faster(dtype)
    for new, decode_seqs, decodes in (([1, 1, 1, 6, 12], 3, 3), ([1, 1, 1, 1, 0], 2, 2),
                                      ([2, 1, 1, 1, 0], 3, 0), ([1, 1, 1, 1, 1], None, 0)):
        seqs = [BatchSeq(row, harness.done[i], [0] * n)
                for i, (row, n) in enumerate(zip(harness.rows, new)) if n]
        batch = make_forward_batch(harness.runner, ForwardMode.EXTEND, seqs,
                                   decode_seqs=decode_seqs)
        harness.backend.init_forward_metadata(batch)
        plan = batch.attn_metadata.native_extend
        assert (plan is not None) == (kernels is not None)
        if plan is not None:
            assert (0 if plan.decodes is None else plan.decodes.rows.shape[0]) == decodes
            assert plan.rows.shape[0] == len(seqs) - decodes
        with cpu.recording() as tape:
            harness.step(ForwardMode.EXTEND, new, decode_seqs)
        assert any(name.startswith("sgl_decode_attention") for name in tape.names) == (
            native and decodes > 0)
        assert any(name.startswith("sgl_extend_attention") for name in tape.names) == native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("restore_kernel_threads", "kernel_isa")
def test_decode_kernel_on_two_threads(dtype: torch.dtype) -> None:
    """The CPU kernel shares a batch's sequences out over its threads; every sequence must still
    be attended (a skipped one leaves torch.empty's garbage, which the reference check sees)."""
    from sgl.kernels import cpu

    assert cpu.load() is not None
    torch.manual_seed(3)
    assert cpu.set_threads(2) == 2
    spec = AttentionLayerSpec(layer_id=0, num_heads=9, num_kv_heads=3, head_dim=64,
                              scaling=0.125)
    harness = Harness(spec, lengths=[40, 9, 23, 17, 6, 31, 12, 26], dtype=dtype)
    harness.step(ForwardMode.EXTEND, [30, 1, 20, 10, 3, 25, 8, 20])
    for _ in range(3):
        harness.step(ForwardMode.DECODE, [1] * 8)


def test_decode_in_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    monkeypatch.setattr(backend_module, "DECODE_CHUNK_TOKENS", 16)
    monkeypatch.setattr(backend_module.cpu, "load", lambda: None)  # the torch path
    spec = AttentionLayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
                              scaling=0.3)
    harness = Harness(spec, lengths=[15, 4, 9, 3, 11])
    harness.step(ForwardMode.EXTEND, [12, 1, 6, 2, 10])
    harness.step(ForwardMode.DECODE, [1, 1, 1, 1, 1])
    seqs = [BatchSeq(row, harness.done[i], [0]) for i, row in enumerate(harness.rows)]
    batch = make_forward_batch(harness.runner, ForwardMode.DECODE, seqs)
    harness.backend.init_forward_metadata(batch)
    chunks = [(c.start, c.end) for c in batch.attn_metadata.decode]
    assert len(chunks) > 1 and chunks[0][0] == 0 and chunks[-1][1] == 5


def test_forward_needs_metadata() -> None:
    spec = AttentionLayerSpec(layer_id=0, num_heads=2, num_kv_heads=2, head_dim=HEAD_DIM,
                              scaling=1.0)
    harness = Harness(spec, lengths=[2])
    batch = make_forward_batch(harness.runner, ForwardMode.EXTEND, [BatchSeq(0, 0, [1, 2])])
    x = torch.zeros(2, 2 * HEAD_DIM)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        harness.backend.forward(x, x, x, spec, batch)


def test_batch_builder_validates() -> None:
    spec = AttentionLayerSpec(layer_id=0, num_heads=2, num_kv_heads=2, head_dim=HEAD_DIM,
                              scaling=1.0)
    runner = Harness(spec, lengths=[1, 1]).runner
    free = runner.kv_pool.num_free
    with pytest.raises(ValueError, match="exactly one new token"):
        make_forward_batch(runner, ForwardMode.DECODE, [BatchSeq(0, 3, [1, 2])])
    with pytest.raises(ValueError, match="context length 256"):
        make_forward_batch(runner, ForwardMode.EXTEND, [BatchSeq(0, 255, [1, 2])])
    with pytest.raises(ValueError, match="share a req_to_token row"):
        make_forward_batch(runner, ForwardMode.EXTEND, [(0, 0, [1]), (0, 0, [2])])
    assert runner.kv_pool.num_free == free  # nothing was taken
    batch = make_forward_batch(runner, ForwardMode.EXTEND, [(0, 0, [5, 6, 7]), (1, 0, [8])])
    assert batch.positions.tolist() == [0, 1, 2, 0]
    assert batch.input_ids.tolist() == [5, 6, 7, 8]
    table = runner.req_to_token_pool.req_to_token
    assert table[0, :3].tolist() + table[1, :1].tolist() == batch.out_cache_loc.tolist()
    assert runner.kv_pool.num_free == free - 4
