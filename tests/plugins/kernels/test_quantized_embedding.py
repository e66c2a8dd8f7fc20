"""The token-embedding lookup in a quantized table (``sgl::embedding_q``).

The kernel is held to the core's reference (the selected rows of
:func:`sgl.kernels.quant.dequantize`, rounded once to the output dtype) bit for bit: ``d q + m``
is exact in float32 before its one rounding, so there is nothing for the two to differ in. At
every kernel level this CPU has, for both layouts and both output dtypes, on ragged widths, one
to many tokens with repeated ids, on two threads, and recorded then replayed with other ids.
"""

from __future__ import annotations

import pytest
import torch

from sgl.kernels import cpu, ops, quant
from sgl.kernels.library import KernelLibrary

FORMATS = ["q4", "q8"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def kernels(kernel_isa: str) -> KernelLibrary:
    loaded = cpu.load()
    assert loaded is not None and cpu.cpu_isa() == kernel_isa
    return loaded


def _table(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A table of every integer the layout holds, and scales and offsets of both signs and of
    magnitudes from 1e-4 to 1e2 (bfloat16's rounding at work in every block)."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == "q4":
        qweight = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen)
    else:
        qweight = torch.randint(-128, 128, (n, k // 32, 32), dtype=torch.int8, generator=gen)
    magnitude = 10 ** (torch.rand(n, k // 32, 2, generator=gen) * 6 - 4)
    sign = torch.randint(0, 2, (n, k // 32, 2), generator=gen) * 2 - 1
    return qweight, (magnitude * sign).half()


def _ids(n: int, t: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, n, (t,), generator=torch.Generator().manual_seed(seed))
    ids[-1] = ids[0]  # a repeated id
    if t > 2:
        ids[1] = n - 1  # the last row
    return ids


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [32, 96, 544, 1536])
@pytest.mark.parametrize("tokens", [1, 7, 70])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_embedding_equals_the_reference(kernels: KernelLibrary, fmt: str, k: int,
                                                  tokens: int, dtype: torch.dtype) -> None:
    qweight, scales = _table(fmt, 300, k, seed=k + tokens)
    ids = _ids(300, tokens, seed=tokens)
    expected = ops.REFERENCES["embedding_q"](qweight, scales, ids, dtype)
    with cpu.recording() as tape:
        got = torch.ops.sgl.embedding_q(qweight, scales, ids, dtype)
    assert tape.names == ["sgl_embedding_quant"]
    assert got.dtype == dtype and got.shape == (tokens, k)
    assert torch.equal(got, expected)
    assert torch.equal(got[-1], got[0])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_table_in_the_x16_layout_gives_the_same_rows(kernels: KernelLibrary, fmt: str,
                                                        dtype: torch.dtype) -> None:
    """A table packed for round_x's matmuls (a tied LM head's, :func:`quant.pack_x16`) is
    looked up with an empty ``scales``: the same rows, bit for bit, kernel and reference."""
    qweight, scales = _table(fmt, 64, 544, seed=3)
    packed = quant.pack_x16(fmt, qweight, scales)
    ids = _ids(64, 70, seed=2)
    no_scales = torch.empty(0, dtype=torch.float16)
    want = torch.ops.sgl.embedding_q(qweight, scales, ids, dtype)
    assert torch.equal(torch.ops.sgl.embedding_q(packed, no_scales, ids, dtype), want)
    assert torch.equal(ops.REFERENCES["embedding_q"](packed, no_scales, ids, dtype), want)
    with pytest.raises(IndexError, match="outside the embedding table of 64 rows"):
        torch.ops.sgl.embedding_q(packed, no_scales, torch.tensor([64]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_q6_table_is_looked_up_packed(kernels: KernelLibrary, dtype: torch.dtype) -> None:
    """A q6 table (GGUF's Q6_K) has a kernel in its x16 layout only (a tied LM head's, which
    is where a Q6_K table is kept as it is): its rows are ``d s (q - 32)``, exact in float32,
    rounded once, as the reference dequantizes them; the plain q6 layout is refused by the
    kernel, which the layers never give it (they widen such a table to q8)."""
    gen = torch.Generator().manual_seed(5)
    qweight = torch.randint(0, 256, (64, 17, 26), dtype=torch.uint8, generator=gen)
    scales = torch.zeros(64, 17, 2, dtype=torch.float16)
    scales[..., 0] = (torch.rand(64, 17, generator=gen) - 0.5) * 1e-3
    packed = quant.pack_x16("q6", qweight, scales)
    ids = _ids(64, 70, seed=2)
    no_scales = torch.empty(0, dtype=torch.float16)
    want = quant.dequantize("q6", qweight, scales)[ids].to(dtype)
    assert torch.equal(torch.ops.sgl.embedding_q(packed, no_scales, ids, dtype), want)
    assert torch.equal(ops.REFERENCES["embedding_q"](packed, no_scales, ids, dtype), want)
    assert torch.equal(ops.REFERENCES["embedding_q"](qweight, scales, ids, dtype), want)
    with pytest.raises(ValueError, match="q6x16, with empty scales"):
        torch.ops.sgl.embedding_q(qweight, scales, ids, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_reference_is_the_dequantized_rows(fmt: str, monkeypatch) -> None:
    """The reference is :func:`quant.dequantize`'s rows rounded once, and dequantizes only the
    rows it returns."""
    qweight, scales = _table(fmt, 50, 64, seed=1)
    ids = torch.tensor([4, 0, 49, 4])
    whole = quant.dequantize(fmt, qweight, scales)
    shapes = []

    def dequantize(*args):
        shapes.append(args[1].shape[0])
        return quant_dequantize(*args)

    quant_dequantize = quant.dequantize
    monkeypatch.setattr(quant, "dequantize", dequantize)
    for dtype in DTYPES:
        assert torch.equal(ops.embedding_q(qweight, scales, ids, dtype), whole[ids].to(dtype))
    assert shapes == [4, 4]


def test_bfloat16_ties_round_to_even(kernels: KernelLibrary) -> None:
    """d = 1, m = 2^-8 or 3 * 2^-8: for q = 1 the value is halfway between two bfloat16 values,
    1 and 1 + 2^-7 (rounds down to 1, the even one), then 1 + 2^-7 and 1 + 2^-6 (rounds up to
    1 + 2^-6), as torch rounds."""
    qweight = (torch.arange(16, dtype=torch.uint8) * 17).expand(2, 1, 16).contiguous()  # 0..15
    scales = torch.tensor([[[1.0, 2.0 ** -8]], [[1.0, 3 * 2.0 ** -8]]]).half()
    ids = torch.tensor([0, 1])
    got = torch.ops.sgl.embedding_q(qweight, scales, ids, torch.bfloat16)
    assert torch.equal(got, ops.embedding_q(qweight, scales, ids, torch.bfloat16))
    assert got[0, 1].item() == 1.0 and got[1, 1].item() == 1 + 2.0 ** -6


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("restore_kernel_threads")
def test_quantized_embedding_on_two_threads_and_replayed(kernels: KernelLibrary, fmt: str,
                                                         dtype: torch.dtype) -> None:
    """Many tokens are shared out over the threads, with the same result; a recorded lookup
    replays with the ids the tensor holds then, and refuses an id outside the table then."""
    qweight, scales = _table(fmt, 1000, 1536, seed=5)
    ids = _ids(1000, 70, seed=6)
    assert cpu.set_threads(1) == 1
    one = torch.ops.sgl.embedding_q(qweight, scales, ids, dtype)
    assert cpu.set_threads(2) == 2
    with cpu.recording() as tape:
        two = torch.ops.sgl.embedding_q(qweight, scales, ids, dtype)
    assert torch.equal(one, two)
    ids.copy_(_ids(1000, 70, seed=7))
    tape.replay()
    assert torch.equal(two, ops.embedding_q(qweight, scales, ids, dtype))
    assert not torch.equal(two, one)
    ids[3] = 1000
    with pytest.raises(RuntimeError, match="sgl_embedding_quant failed on replay"):
        tape.replay()


def test_no_tokens(kernels: KernelLibrary) -> None:
    qweight, scales = _table("q8", 10, 64, seed=2)
    got = torch.ops.sgl.embedding_q(qweight, scales, torch.zeros(0, dtype=torch.int64),
                                    torch.float32)
    assert got.shape == (0, 64) and got.dtype == torch.float32


def _kernel_and_reference() -> list:
    return [torch.ops.sgl.embedding_q, ops.REFERENCES["embedding_q"]]


@pytest.mark.parametrize("bad_id", [10, -1])
def test_an_id_outside_the_table_is_an_index_error(kernels: KernelLibrary, bad_id: int) -> None:
    qweight, scales = _table("q4", 10, 64, seed=3)
    for op in _kernel_and_reference():
        with pytest.raises(IndexError, match="embedding_q: token id outside the embedding "
                                             "table of 10 rows"):
            op(qweight, scales, torch.tensor([0, bad_id, 2]), torch.float32)


@pytest.mark.parametrize("args, message", [
    (lambda q, s, i: (q.view(torch.int8), s, i, torch.float32), "qweight must be"),
    (lambda q, s, i: (q.flatten(1), s, i, torch.float32), "qweight must be"),
    (lambda q, s, i: (q.float(), s, i, torch.float32), "qweight must be"),
    (lambda q, s, i: (q, s.float(), i, torch.float32), "scales must be"),
    (lambda q, s, i: (q, s[:, :1].contiguous(), i, torch.float32), "scales must be"),
    (lambda q, s, i: (q, s, i.int(), torch.float32), "ids must be a 1-D int64"),
    (lambda q, s, i: (q, s, i[None], torch.float32), "ids must be a 1-D int64"),
    (lambda q, s, i: (q, s, i, torch.int64), "dtype must be"),
])
def test_quantized_embedding_names_bad_arguments(kernels: KernelLibrary, args,
                                                 message: str) -> None:
    qweight, scales = _table("q4", 10, 64, seed=4)
    for op in _kernel_and_reference():
        with pytest.raises(ValueError, match="embedding_q: " + message):
            op(*args(qweight, scales, torch.tensor([1, 2])))


def test_the_kernel_takes_float32_and_bfloat16_the_reference_any_float(
        kernels: KernelLibrary) -> None:
    qweight, scales = _table("q8", 10, 64, seed=4)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="sgl::embedding_q: dtype must be float32 or bfloat16, "
                                         "got Half"):
        torch.ops.sgl.embedding_q(qweight, scales, ids, torch.float16)
    got = ops.embedding_q(qweight, scales, ids, torch.float16)
    assert got.dtype == torch.float16
    assert torch.equal(got, quant.dequantize("q8", qweight, scales)[ids].half())
