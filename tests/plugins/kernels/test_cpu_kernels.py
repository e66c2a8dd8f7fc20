"""sgl's CPU kernels (sgl-kernels-cpu, through ``sgl.kernels.cpu``) against the torch code they
replace and the reference implementations of ``sgl.kernels.ops``, at every kernel level of the
instruction-set ladder this CPU has (the ``kernel_isa`` fixture).

The elementwise kernels round where torch rounds, so for bfloat16 they must agree bit for bit;
the matmul and the attention sum in another order, so they agree to rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl.kernels import cpu
from sgl.kernels import ops
from sgl.kernels.library import KernelLibrary, PackedWeight
from sgl.layers.packed_linear import linear, pack_weight
from sgl.layers.rotary import RotaryEmbedding

sgl_ops = torch.ops.sgl


@pytest.fixture
def kernels(kernel_isa: str) -> KernelLibrary:
    """The kernel library at the test's level."""
    loaded = cpu.load()
    assert loaded is not None and cpu.cpu_isa() == kernel_isa
    return loaded


def bf16_kernel_name(level: str) -> str:
    return {"amx": "sgl_linear_bf16_amx", "avx2": "sgl_linear_bf16_avx2"}.get(
        level, "sgl_linear_bf16_avx512")


def kernel_name(kernel: str, level: str) -> str:
    """The name of ``kernel`` (``sgl_rmsnorm``, ...) in a tape recorded at ``level``."""
    return f"{kernel}_avx2" if level == "avx2" else kernel


def reference_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 40), (48, 64)])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16, 17, 32, 33, 64])
@pytest.mark.usefixtures("one_torch_thread")  # the kernel runs where torch runs on one thread
def test_bf16_linear(kernels: KernelLibrary, n: int, k: int, rows: int) -> None:
    """The bfloat16 matmul of the level: AMX tiles, AVX512-BF16 dot products or widened AVX-512
    FMAs, all on the same packed weight."""
    torch.manual_seed(n + k + rows)
    weight = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    packed = pack_weight(weight, bias)
    assert isinstance(packed, PackedWeight) and packed.kind == "bf16"
    x = torch.randn(rows, 2 * k).bfloat16()[:, :k]  # a row-strided view
    expected = F.linear(x.float(), weight.float(), bias.float())
    with cpu.recording() as tape:
        got = linear(x, weight, bias, packed).float()
    assert tape.names == [bf16_kernel_name(cpu.cpu_isa())]
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.05)


@pytest.mark.parametrize("n,k", [(960, 576), (100, 40)])
@pytest.mark.parametrize("rows", [1, 9, 33])
def test_bf16_dot_and_widened_matmuls_agree(avx512_isa: str, n: int, k: int, rows: int) -> None:
    """Both AVX-512 bfloat16 matmuls, whichever the CPU's vendor picks: the widened one at
    every AVX-512 level, the vdpbf16ps one where the level has AVX512-BF16."""
    kernels = cpu.load()
    assert kernels is not None and cpu.cpu_isa() == avx512_isa
    torch.manual_seed(rows + n)
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).float()
    packed = cpu.pack_bf16_weight(weight)
    x = torch.randn(rows, k).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias)
    try:
        for level, dot in ([("avx512", False), ("avx512_bf16", True)]
                           if cpu.isa_at_least(avx512_isa, "avx512_bf16") else [("avx512", False)]):
            kernels.set_level(level, cpu.isa_emulated(), dot_products=dot)
            with cpu.recording() as tape:
                y = sgl_ops.linear_bf16(x, packed, n, bias)
            assert tape.names == ["sgl_linear_bf16_avx512"]
            assert int(tape.calls[0, 10]) == int(dot)  # the kernel's dp argument
            torch.testing.assert_close(y.float(), expected, rtol=0.02, atol=0.05)
    finally:
        kernels.set_level(avx512_isa, cpu.isa_emulated())


@pytest.mark.parametrize("n,k", [(49152, 576), (960, 576), (100, 40)])
@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.usefixtures("one_torch_thread", "restore_kernel_threads")
def test_bf16_linear_threads_share_the_columns(kernels: KernelLibrary, n: int, k: int,
                                               rows: int) -> None:
    """On two kernel threads the product has the same bits as on one (each column is computed
    by one thread, in the same order): a chunk that no thread ran would leave torch.empty's
    garbage. With two threads linear() takes the kernel above AMX_MAX_ROWS rows too."""
    torch.manual_seed(n + rows)
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    packed = pack_weight(weight, bias)
    assert packed is not None and packed.kind == "bf16"
    x = torch.randn(rows, k).bfloat16()
    assert cpu.set_threads(1) == 1
    one = sgl_ops.linear_bf16(x, packed.tensor, n, packed.bias)
    assert cpu.set_threads(2) == 2 == cpu.kernel_threads()
    two = [sgl_ops.linear_bf16(x, packed.tensor, n, packed.bias) for _ in range(3)]
    with cpu.recording() as tape:
        via_layer = linear(x, weight, bias, packed)
    assert tape.names == [bf16_kernel_name(cpu.cpu_isa())]
    for got in two + [via_layer]:
        assert torch.equal(got, one)
    torch.testing.assert_close(one.float(), F.linear(x.float(), weight.float(), bias.float()),
                               rtol=0.02, atol=0.1)


@pytest.mark.parametrize("n,k", [(960, 576), (100, 40), (49, 7)])
@pytest.mark.parametrize("rows", [4, 7, 8, 9, 32, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.usefixtures("one_torch_thread", "kernel_isa")  # the kernel runs on one torch thread
def test_f32_linear(n: int, k: int, rows: int, with_bias: bool) -> None:
    torch.manual_seed(n + k + rows)
    weight = torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    packed = pack_weight(weight, bias)
    assert isinstance(packed, PackedWeight) and packed.kind == "f32"
    x = torch.randn(rows, 2 * k)[:, :k]  # a row-strided view
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = linear(x, weight, bias, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n,k", [(49152, 576), (960, 576), (49, 7)])
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.usefixtures("one_torch_thread", "restore_kernel_threads")
def test_f32_linear_threads_share_the_columns(kernels: KernelLibrary, n: int, k: int,
                                              rows: int) -> None:
    """On two kernel threads the float32 kernel splits its column panels: same bits as one
    thread, and linear() takes it for any row count (with one thread only for 4-64 rows)."""
    torch.manual_seed(n + k + rows)
    weight, bias = torch.randn(n, k), torch.randn(n)
    packed = pack_weight(weight, bias)
    assert packed is not None and packed.kind == "f32"
    x = torch.randn(rows, k)
    cpu.set_threads(1)
    one = sgl_ops.linear_f32(x, packed.tensor, n, packed.bias)
    cpu.set_threads(2)
    two = [sgl_ops.linear_f32(x, packed.tensor, n, packed.bias) for _ in range(3)]
    with cpu.recording() as tape:
        via_layer = linear(x, weight, bias, packed)
    for got in two + [via_layer]:
        assert torch.equal(got, one)
    assert len(tape) == 1  # the kernel, not torch's matmul
    torch.testing.assert_close(one.double(), F.linear(x.double(), weight.double(),
                                                      bias.double()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 576), (33, 576), (5, 40), (3, 4096)])
def test_rmsnorm_and_silu(kernels: KernelLibrary, dtype: torch.dtype, rows: int,
                          width: int) -> None:
    torch.manual_seed(rows * width)
    x = (torch.randn(rows, width) * 3).to(dtype)
    residual = torch.randn(rows, width).to(dtype)
    weight = (torch.rand(width) + 0.5).to(dtype)
    out, summed = sgl_ops.add_rmsnorm(x, residual, weight.view(1, -1), 1e-5)
    assert torch.equal(summed, x + residual)
    expected = reference_rmsnorm(x + residual, weight, 1e-5)
    gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
    silu = sgl_ops.silu_mul(gate_up)
    silu_expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    if dtype == torch.bfloat16:  # same roundings as torch: bit for bit
        assert torch.equal(out, expected)
        assert torch.equal(silu, silu_expected)
    else:  # float32: another summation order / exp
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(silu, silu_expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_rounding_of_denormal_results(kernels: KernelLibrary) -> None:
    """Results in the denormal range (sums of tiny values, SiLU of gates below -88, rotations
    of tiny features) are rounded to bfloat16 as torch rounds them, not flushed to zero as
    vcvtneps2bf16 would; at the emulated levels this also needs VSCALEFPS's single rounding of
    p * 2^128 (the exponential of SiLU's -gate), which SIMDe's version overflows."""
    torch.manual_seed(9)
    tiny = torch.randn(6, 64) * 1e-39  # float32 denormals, rounded to bfloat16 denormals
    x = torch.cat([tiny, torch.randn(6, 64)], 0).to(torch.bfloat16)
    residual = torch.cat([tiny.flip(0), torch.randn(6, 64)], 0).to(torch.bfloat16)
    weight = (torch.rand(64) + 0.5).to(torch.bfloat16)
    out, summed = sgl_ops.add_rmsnorm(x, residual, weight.view(1, -1), 1e-5)
    assert torch.equal(summed, x + residual)
    assert (summed[:6] != 0).any() and (summed[:6].abs() < 1.2e-38).all()  # denormals, kept
    assert torch.equal(out, reference_rmsnorm(x + residual, weight, 1e-5))
    gate_up = torch.cat([torch.rand(12, 64) * -10 - 88, torch.randn(12, 64) * 4], 1)
    gate_up = gate_up.to(torch.bfloat16)
    silu = sgl_ops.silu_mul(gate_up)
    assert torch.equal(silu, F.silu(gate_up[:, :64]) * gate_up[:, 64:])
    assert (silu != 0).any()
    rope = RotaryEmbedding(64, 64, 128, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.arange(12)
    cos, sin = rope._rows(positions, torch.bfloat16)
    q = x.repeat(1, 3)
    assert torch.equal(sgl_ops.rotary(q, 3, 64, 64, rope._table_rows(positions, torch.bfloat16),
                                      None), rope._rotate(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 48), (96, 40), (128, 128)])
def test_rotary_bit_identical(kernels: KernelLibrary, dtype: torch.dtype, head_dim: int,
                              rotary_dim: int) -> None:
    torch.manual_seed(head_dim + rotary_dim)
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096,
                           {"rope_type": "default", "rope_theta": 10000.0})
    q_heads, kv_heads, tokens = 9, 3, 7
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    positions = torch.randint(0, 4000, (tokens,))
    cos, sin = rope._rows(positions, dtype)
    expected = rope._rotate(q, cos, sin)  # the torch path
    got = sgl_ops.rotary(q, q_heads, head_dim, rotary_dim, rope._table_rows(positions, dtype), None)
    assert torch.equal(got, expected)
    # the whole table with the positions, as RotaryEmbedding passes it
    table = rope._full_table(dtype)
    assert torch.equal(sgl_ops.rotary(q, q_heads, head_dim, rotary_dim, table, positions),
                       expected)
    assert torch.equal(rope(positions, q, k)[0], expected)


def test_rotary_position_outside_the_table(kernels: KernelLibrary) -> None:
    rope = RotaryEmbedding(64, 64, 128, {"rope_type": "default", "rope_theta": 10000.0})
    q = torch.randn(2, 3 * 64)
    table = rope._full_table(torch.float32)
    for bad in (128, -1):
        with pytest.raises(IndexError, match="outside the 128 rows"):
            sgl_ops.rotary(q, 3, 64, 64, table, torch.tensor([5, bad]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_kernel(kernels: KernelLibrary, dtype: torch.dtype) -> None:
    from sgl.layers.embedding import VocabParallelEmbedding

    torch.manual_seed(1)
    emb = VocabParallelEmbedding(100, 24, dtype=dtype)
    emb.weight.data.copy_(torch.randn(100, 24))
    ids = torch.tensor([0, 99, 7, 7, 42])
    assert torch.equal(sgl_ops.embedding(emb.weight, ids), F.embedding(ids, emb.weight))
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    assert sgl_ops.embedding(emb.weight, ids[:0]).shape == (0, 24)
    for bad in (100, -1):
        with pytest.raises(IndexError, match="outside the embedding table of 100 rows"):
            emb(torch.tensor([3, bad]))


def test_recording_keeps_the_calls_and_replays_them(kernels: KernelLibrary) -> None:
    x = torch.randn(3, 8)
    weight = torch.randn(1, 8)
    with cpu.recording() as tape:
        out = sgl_ops.rmsnorm(x, weight, 1e-6)
        with pytest.raises(RuntimeError, match="already recording"):
            with cpu.recording():
                pass
    assert len(tape) == 1 and any(t is out for t in tape.outputs)
    assert any(t is x for t in tape.inputs)
    first = out.clone()
    x.copy_(torch.randn(3, 8))  # replay reads the recorded tensors as they are now
    tape.replay()
    assert not torch.equal(out, first)
    torch.testing.assert_close(out, sgl_ops.rmsnorm(x, weight, 1e-6), rtol=0, atol=0)
    sgl_ops.rmsnorm(x, weight, 1e-6)  # outside the block: not recorded
    assert len(tape) == 1


def test_replay_reports_the_call_that_failed(kernels: KernelLibrary) -> None:
    table = torch.randn(10, 4)
    ids = torch.tensor([1, 2])
    with cpu.recording() as tape:
        rows = sgl_ops.embedding(table, ids)
        out = sgl_ops.silu_mul(rows)
    ids[1] = 10  # outside the table: sgl_embedding refuses, silu_mul does not run
    before = out.clone()
    with pytest.raises(RuntimeError, match="sgl_embedding failed on replay"):
        tape.replay()
    assert torch.equal(out, before)
    ids[1] = 3
    tape.replay()
    assert torch.equal(rows, table[[1, 3]])


@pytest.mark.usefixtures("restore_kernel_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_parts_replay_at_once_each_as_alone(kernels: KernelLibrary, threads: int) -> None:
    """Tapes replayed as the parts of one call (one kernel thread each where there are two; the
    kernels inside a part then run their loops on its thread alone) give what each gives alone,
    and a part that fails names its call while the other part still runs."""
    assert cpu.set_threads(threads) == threads
    tables, ids, outs = [], [], []
    tapes = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        tables.append(torch.randn(50, 96))
        ids.append(torch.randint(0, 50, (64,)))  # enough rows to share out over two threads
        with cpu.recording() as tape:
            rows = sgl_ops.embedding(tables[-1], ids[-1])
            outs.append(sgl_ops.silu_mul(sgl_ops.rmsnorm(rows, torch.ones(1, 96), 1e-6)))
        tapes.append(tape)

    def expected(part: int) -> torch.Tensor:
        return sgl_ops.silu_mul(sgl_ops.rmsnorm(tables[part][ids[part]], torch.ones(1, 96), 1e-6))

    for part in (0, 1):
        ids[part].copy_(torch.randint(0, 50, (64,)))
        outs[part].zero_()
    kernels.replay_parts(tapes)
    for part in (0, 1):
        assert torch.equal(outs[part], expected(part)), part
    ids[0][5] = 50  # outside the table: part 0 stops at its first call, part 1 runs
    ids[1].copy_(torch.randint(0, 50, (64,)))
    before = outs[0].clone()
    with pytest.raises(RuntimeError, match=r"sgl_embedding failed on replay \(call 1 of 3\)"):
        kernels.replay_parts(tapes)
    assert torch.equal(outs[0], before)
    assert torch.equal(outs[1], expected(1))


def test_replay_refuses_a_call_it_does_not_know(kernels: KernelLibrary) -> None:
    """A recorded row whose kernel the library does not have fails with its kind, and nothing
    after it runs."""
    x = torch.randn(2, 8)
    with cpu.recording() as tape:
        sgl_ops.silu_mul(x)
        out = sgl_ops.silu_mul(x)
    tape.calls[0, 0] = 99
    out.zero_()
    with pytest.raises(RuntimeError, match="kind 99 failed on replay"):
        tape.replay()
    assert not out.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_per_head_on_a_strided_view(kernels: KernelLibrary,
                                            dtype: torch.dtype) -> None:
    """Qwen3's q/k norms: each head's features normed on their own, read in place from q and k
    split off a fused qkv output."""
    from sgl.layers.norm import RMSNorm

    torch.manual_seed(4)
    norm = RMSNorm(32, 1e-6, dtype=dtype)
    norm.weight.data.copy_(torch.randn(32))
    qkv = torch.randn(11, (4 + 2 + 2) * 32).to(dtype)
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], -1)
    for x in (q, k):
        expected = reference_rmsnorm(x.reshape(-1, 32), norm.weight, 1e-6).view(11, -1)
        got = norm.per_head(x, 32)
        assert got.is_contiguous() and got.shape == x.shape
        if dtype == torch.bfloat16:  # rounds where torch rounds
            assert torch.equal(got, expected)
        else:  # another summation order
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not whole heads of 32"):  # narrower than one head
        sgl_ops.rmsnorm_heads(torch.randn(2, 16).to(dtype), norm.weight.view(1, -1), 1e-6, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 8, 9, 33, 200])
@pytest.mark.usefixtures("restore_kernel_threads")
def test_row_kernels_on_two_threads(kernels: KernelLibrary, dtype: torch.dtype,
                                    rows: int) -> None:
    """Norm, SiLU x up and rotary split their rows over the kernel threads (8 or more rows per
    chunk): every row is written, with the bits of one thread."""
    torch.manual_seed(rows)
    rope = RotaryEmbedding(64, 64, 1024, {"rope_type": "default", "rope_theta": 10000.0})
    table = rope._full_table(dtype)
    x, residual = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
    weight = torch.randn(1, 576).to(dtype)
    gate_up = torch.randn(rows, 2 * 1536).to(dtype)
    positions = torch.randint(0, 1024, (rows,))

    def run_all() -> list[torch.Tensor]:
        return [*sgl_ops.add_rmsnorm(x, residual, weight, 1e-6), sgl_ops.rmsnorm(x, weight, 1e-6),
                sgl_ops.silu_mul(gate_up), sgl_ops.rotary(x, 9, 64, 64, table, positions)]

    cpu.set_threads(1)
    one = run_all()
    cpu.set_threads(2)
    two = [run_all() for _ in range(3)]
    for results in two:
        for got, expected in zip(results, one):
            assert torch.equal(got, expected)
    assert torch.equal(one[-1], rope._rotate(x, *rope._rows(positions, dtype)))


@pytest.mark.usefixtures("cpu_isa")
def test_argmax_rows() -> None:
    torch.manual_seed(0)
    x = torch.randn(33, 49152)
    x[3, 7] = x[3, 900] = 100.0  # ties: the first index wins
    x[5, 40] = x[5, 60] = float("nan")  # NaN counts as the maximum
    x[6] = float("-inf")
    assert torch.equal(cpu.argmax_rows(x), x.argmax(-1))
    assert torch.equal(cpu.argmax_rows(x[:, :17]), x[:, :17].argmax(-1))


@pytest.mark.usefixtures("one_torch_thread")
def test_each_level_runs_its_own_kernels_or_torch(cpu_isa: str) -> None:
    """At a kernel level (avx2 included) the layers pack their weights for sgl's kernels; at
    none nothing of sgl's runs and the layers give torch's results."""
    assert cpu.cpu_isa() == cpu_isa and cpu_isa in cpu.describe_isa()
    weight = torch.randn(64, 32).bfloat16()
    packed = pack_weight(weight)
    x = torch.randn(3, 32).bfloat16()
    with cpu.recording() as tape:
        got = linear(x, weight, None, packed)
        picked = cpu.argmax_rows(torch.randn(4, 100))
    if cpu_isa in cpu.kernel_levels():
        assert cpu.load() is not None and packed is not None and packed.kind == "bf16"
        assert tape.names == [bf16_kernel_name(cpu_isa), kernel_name("sgl_argmax_f32", cpu_isa)]
        assert pack_weight(torch.randn(64, 32)).kind == "f32"
    else:
        assert cpu.load() is None and not len(tape) and picked.shape == (4,)
        assert packed is None or packed.kind == "onednn"
        assert pack_weight(torch.randn(64, 32)) is None  # float32 stays with MKL
    torch.testing.assert_close(got, F.linear(x, weight), rtol=0.02, atol=0.05)


def test_isa_cap_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGL_CPU_ISA caps the level, never above what the CPU has; a name outside the ladder is
    an error that lists the names; SGL_CPU_KERNELS=0 means none."""
    monkeypatch.setattr(cpu._state, "isa_cap", None)
    monkeypatch.delenv("SGL_CPU_KERNELS", raising=False)  # a run under SGL_CPU_KERNELS=0 too
    detected = cpu.detected_isa()
    for level in cpu.isa_levels():
        monkeypatch.setenv("SGL_CPU_ISA", level)
        expected = level if cpu.isa_at_least(detected, level) else detected
        assert cpu.effective_isa(cpu.requested_isa()) == expected
    monkeypatch.setenv("SGL_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="SGL_CPU_ISA='sse2': expected auto or one of amx, "):
        cpu.requested_isa()
    monkeypatch.setenv("SGL_CPU_ISA", "auto")
    assert cpu.effective_isa(cpu.requested_isa()) == detected
    monkeypatch.setenv("SGL_CPU_KERNELS", "0")
    assert cpu.requested_isa() == "none"
    with pytest.raises(ValueError, match="expected auto or one of"):
        cpu.set_isa("avx1024")


def test_auto_dtype_follows_the_level(cpu_isa: str, caplog: pytest.LogCaptureFixture) -> None:
    """--dtype auto is bfloat16 at the levels with bfloat16 instructions (amx, avx512_bf16),
    float32 at the others, and the reason names the level."""
    from sgl.engine.model_runner import auto_cpu_dtype, resolve_dtype

    dtype, why = auto_cpu_dtype()
    assert dtype == (torch.bfloat16 if cpu_isa in ("amx", "avx512_bf16") else torch.float32)
    assert why.startswith(str(dtype).removeprefix("torch.")) and f"at {cpu_isa}," in why
    assert resolve_dtype("auto", None, torch.device("cpu")) == dtype
    assert resolve_dtype("float32", None, torch.device("cpu")) == torch.float32
