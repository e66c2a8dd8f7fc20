"""Batch invariance of the matmul kernels: every row of ``torch.ops.sgl.linear_*`` is the same
bits whether it is computed alone, with a few other rows (the decode paths) or with many (the
prefill panels), at any thread count and wherever it sits in the batch. Greedy decoding in
sgl rests on this: a request's tokens must not depend on what else shares its forward, nor on
a prefix-cache hit turning its prompt into a one-row extend (issue 54's wrong answer came from
the quantized matmul of one row rounding its weights differently from the matmul of many).

Drawn with hypothesis at every kernel level (emulated ones included): the operator, its
weight layout, the activations' dtype, the shape, the rows of the full call and the slice
taken from it. ``q4x`` and ``q8x`` are the quantized operators with ``round_x``
(``--int8-activations on``): each row rounded to int8 per block on its own, the integer sums
exact, then one float sequence in every tile, so they are held to the same bits too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl.kernels import cpu, ops, quant

# rows on both sides of every threshold of the kernels (AVX2 and AVX-512 quantized: 12; the
# direct one-row paths; the 8-row bfloat16 tiles; the float32 6-row tiles and their 2-row path;
# round_x: 4- and 8-row tiles, the 16-column tiles from 8 rows, AMX's from 16)
FULL_ROWS = (1, 2, 3, 4, 5, 8, 11, 12, 13, 16, 17, 40)
OPERATORS = ("dense", "q4", "q8", "q4x", "q8x")


def _matmul(kind: str, dtype: torch.dtype, n: int, k: int, seed: int):
    """``x -> x @ W^T + bias`` through the operator of ``kind`` for a random ``W [n, k]``."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    if kind == "dense" and dtype == torch.bfloat16:
        packed = ops.pack_bf16_weight(weight.bfloat16())
        return lambda x: torch.ops.sgl.linear_bf16(x, packed, n, bias)
    if kind == "dense":
        packed = ops.pack_f32_weight(weight)
        return lambda x: torch.ops.sgl.linear_f32(x, packed, n, bias)
    qweight, scales = quant.quantize(kind[:2], weight)
    op = torch.ops.sgl.linear_q4 if kind.startswith("q4") else torch.ops.sgl.linear_q8
    round_x = kind.endswith("x")
    return lambda x: op(x, qweight, scales, bias, round_x)


@pytest.mark.usefixtures("kernel_isa", "restore_kernel_threads")
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(OPERATORS), bf16=st.booleans(),
       n=st.sampled_from([16, 40, 96]), k=st.sampled_from([64, 96, 576]),
       full=st.sampled_from(FULL_ROWS), data=st.data())
def test_rows_do_not_depend_on_the_batch(kind: str, bf16: bool, n: int, k: int, full: int,
                                         data: st.DataObject) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    matmul = _matmul(kind, dtype, n, k, seed=n + k + full)
    x = (torch.randn(full, k, generator=torch.Generator().manual_seed(full)) * 2).to(dtype)
    cpu.set_threads(2)
    whole = matmul(x)
    start = data.draw(st.integers(0, full - 1), label="start")
    rows = data.draw(st.integers(1, full - start), label="rows")
    threads = data.draw(st.sampled_from([1, 2, 3]), label="threads")
    cpu.set_threads(threads)
    part = matmul(x[start:start + rows].contiguous())
    assert torch.equal(part, whole[start:start + rows]), (
        f"{kind} {dtype} [{n}, {k}]: rows {start}..{start + rows} of {full} on {threads} "
        f"thread(s) differ from the same rows of the whole call by up to "
        f"{(part.float() - whole[start:start + rows].float()).abs().max().item():.3g}")


@pytest.mark.parametrize("kind", OPERATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernel_isa", "restore_kernel_threads")
def test_one_row_equals_its_row_of_a_prefill(kind: str, dtype: torch.dtype) -> None:
    """The shapes of the bundled SmolLM2 (hidden 576, MLP 1536): the last prompt row computed
    alone, as after a prefix-cache hit, equals that row of the 37-row prefill, and stays
    close to the reference (the invariance is not that of a wrong result)."""
    for n, k in ((576, 576), (1536, 576), (576, 1536)):
        matmul = _matmul(kind, dtype, n, k, seed=n * 3 + k)
        x = torch.randn(37, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        prefill = matmul(x)
        alone = matmul(x[36:].contiguous())
        assert torch.equal(alone, prefill[36:]), (kind, dtype, n, k)
    if kind != "dense":  # the quantized kernels against the dequantized weight
        gen = torch.Generator().manual_seed(n * 3 + k)
        weight = torch.randn(n, k, generator=gen) * 0.05
        bias = torch.randn(n, generator=gen)
        qweight, scales = quant.quantize(kind[:2], weight)
        if kind.endswith("x"):  # round_x: the reference rounds x as the kernels do
            reference = ops.linear_q4 if kind == "q4x" else ops.linear_q8
            expected = reference(x.float(), qweight, scales, bias, True)
        else:
            expected = x.float() @ quant.dequantize(kind, qweight, scales).T + bias
        tol = {"rtol": 0.02, "atol": 0.05} if dtype == torch.bfloat16 else {"rtol": 1e-4,
                                                                            "atol": 1e-4}
        torch.testing.assert_close(prefill.float(), expected, **tol)
