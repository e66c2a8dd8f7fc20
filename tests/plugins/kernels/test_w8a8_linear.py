"""The int8 matmul (``sgl::linear_w8a8``, SGLang's ``w8a8_int8`` scheme) and its packed weight.

The kernels sum integers exactly and then do the reference's float32 operations in its order, so
at every kernel level (AMX tiles, AVX512-VNNI, AVX2; emulated where this CPU lacks the level)
they must give the reference's bits exactly, on ragged shapes, both activation dtypes, row
counts on both sides of the AMX threshold, a row-strided input, two threads and a replay.
"""

from __future__ import annotations

import pytest
import torch

from sgl.kernels import cpu, ops, quant
from sgl.kernels.library import KernelLibrary

SHAPES = [(96, 576), (67, 1000), (1, 4), (33, 64), (130, 200), (16, 4100)]
ROWS = [1, 2, 3, 4, 5, 8, 15, 16, 17, 33, 40]


@pytest.fixture
def kernels(kernel_isa: str) -> KernelLibrary:
    loaded = cpu.load()
    assert loaded is not None and cpu.cpu_isa() == kernel_isa
    return loaded


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random int8 weight with the extremes in it, its packed copy and per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    w[0, 0], w[-1, -1] = -128, 127
    return w, ops.pack_int8_weight(w), torch.rand(n, generator=g) * 0.02


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_packed_weight_holds_every_value(n: int, k: int) -> None:
    w, packed, _ = _weight(n, k, n + k)
    assert packed.dtype == torch.uint8
    assert packed.shape == (-(-n // 16), -(-k // 64) * 16, 64)
    assert torch.equal(ops.unpack_int8_weight(packed, n, k), w)
    # the padding holds w = 0 (stored 128)
    full = ops.unpack_int8_weight(packed, packed.shape[0] * 16, packed.shape[1] * 4)
    assert not full[n:].any() and not full[:, k:].any()
    # channel c's values 4s .. 4s + 3 lie side by side at step s of its group, plus 128
    c, step = min(n - 1, 17), min(k // 4 - 1, 3)
    got = packed[c // 16, step, 4 * (c % 16):4 * (c % 16) + 4].to(torch.int16) - 128
    assert torch.equal(got, w[c, 4 * step:4 * step + 4].to(torch.int16))


def test_pack_refuses_what_is_not_an_int8_matrix() -> None:
    with pytest.raises(ValueError, match="int8 \\[N, K\\] weight"):
        ops.pack_int8_weight(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="int8 \\[N, K\\] weight"):
        ops.pack_int8_weight(torch.zeros(4, dtype=torch.int8))


def test_the_reference_rounds_each_row_and_sums_exactly() -> None:
    """The reference equals a float64 matmul of the rounded rows (q * sx) by the weight, and
    stays within the rounding's bound of the exact product (each value of x moves by at most
    sx / 2 = max|x| / 254 of its row)."""
    torch.manual_seed(7)
    w, packed, scales = _weight(9, 320, 1)
    x = torch.randn(3, 320) * torch.linspace(0.1, 4, 320)
    x[1] = 0  # an all-zero row: sx = 0, nothing rounded
    q, sx = ops.round_x_rows(x)
    assert q.abs().amax() == 127 and sx[1] == 0 and not q[1].any()
    dense = w.double() * scales.double().unsqueeze(-1)
    got = ops.linear_w8a8(x, packed, scales, None)
    rounded = q.double() * sx.double().unsqueeze(-1)
    torch.testing.assert_close(got.double(), rounded @ dense.t(), rtol=1e-6, atol=1e-6)
    exact = x.double() @ dense.t()
    bound = (sx.double() / 2).unsqueeze(-1) * dense.abs().sum(-1)
    assert ((got.double() - exact).abs() <= bound + 1e-6).all()
    assert (got.double() - exact).abs().max() > 1e-4  # x was rounded


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_give_the_references_bits(kernels: KernelLibrary, n: int, k: int,
                                              dtype: torch.dtype) -> None:
    _, packed, scales = _weight(n, k, n * k)
    bias = torch.randn(n)
    names = set()
    for rows in ROWS:
        torch.manual_seed(rows)
        x = (torch.randn(rows, k + 24) * 3).to(dtype)[:, 8:8 + k]  # a row-strided view
        if rows == 5:
            x[2] = 0
        b = bias if rows % 2 else None
        expected = ops.linear_w8a8(x, packed, scales, b)
        with cpu.recording() as tape:
            got = torch.ops.sgl.linear_w8a8(x, packed, scales, b)
        names.update(tape.names)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert torch.equal(got, expected), (rows, (got.float() - expected.float()).abs().max())
    assert names == {"sgl_linear_w8a8_avx2" if cpu.cpu_isa() == "avx2"
                     else "sgl_linear_w8a8_avx512"}


@pytest.mark.usefixtures("restore_kernel_threads")
def test_two_threads_give_one_threads_bits_and_a_replay_reads_new_rows(
        kernels: KernelLibrary) -> None:
    _, packed, scales = _weight(1000, 576, 3)
    for rows in (3, 24):  # the VNNI tiles and, at amx, the AMX tiles
        x = torch.randn(rows, 576).bfloat16()
        assert cpu.set_threads(1) == 1
        one = torch.ops.sgl.linear_w8a8(x, packed, scales, None)
        assert cpu.set_threads(2) == 2
        with cpu.recording() as tape:
            two = torch.ops.sgl.linear_w8a8(x, packed, scales, None)
        assert torch.equal(one, two)
        x.copy_(torch.randn(rows, 576))
        tape.replay()
        assert torch.equal(two, ops.linear_w8a8(x, packed, scales, None))


@pytest.mark.parametrize("args, message", [
    (lambda p, s: (torch.randn(2, 64), p, s.double(), None), "scales must be a contiguous"),
    (lambda p, s: (torch.randn(2, 128), p, s, None), "packing of a weight with 4 rows"),
    (lambda p, s: (torch.randn(2, 64), p.view(torch.int8), s, None), "packed must be"),
    (lambda p, s: (torch.randn(2, 64).half(), p, s, None), "float32 or bfloat16"),
    (lambda p, s: (torch.randn(2, 64), p, s, torch.randn(5)), "bias has 5 values, not 4"),
    (lambda p, s: (torch.randn(2, 64), p, torch.rand(40), None), "packing of a weight with 40"),
])
def test_bad_arguments_are_named(kernels: KernelLibrary, args, message: str) -> None:
    _, packed, scales = _weight(4, 64, 5)
    with pytest.raises(ValueError, match=message):
        torch.ops.sgl.linear_w8a8(*args(packed, scales))


def test_the_channel_layout_rounds_each_row_over_its_own_range() -> None:
    torch.manual_seed(2)
    w = torch.randn(6, 40) * torch.linspace(0.01, 2, 6).unsqueeze(-1)
    w[3] = 0
    q, scales = quant.quantize("w8", w)
    assert q.dtype == torch.int8 and scales.shape == (6, 1) and scales.dtype == torch.float32
    assert (q.abs().amax(-1)[[0, 1, 2, 4, 5]] == 127).all() and not q[3].any()
    back = quant.dequantize("w8", q, scales)
    assert ((back - w).abs() <= scales / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="w8 scales must be float32"):
        quant.check("w8", q, scales.half())
