"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) repacked into sgl's q4/q8/q6 blocks
(sgl.model_loader.gguf_kquants) against ``gguf``'s own dequantization of the same bytes, and q6
rounded to q8 (sgl.kernels.quant.requantize_q6) for the kernels that take q4 and q8 only.

The blocks are random bytes with the float16 super-block scales overwritten by finite values,
so every scale, min and integer llama.cpp can write occurs. Each value is held to the bound the
module states, with the scales and mins taken from ``gguf``'s unpacking, not sgl's; blocks
whose scales are float16 numbers must come out bit for bit. The checks are shown to fail on a
wrong nibble order, scale unpacking or high-bit order.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl.kernels import quant
from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader import gguf_kquants
from sgl.model_loader.gguf_weights import GGUF_QUANTIZED, GGUFWeights, repack_gguf_blocks

gguf = pytest.importorskip("gguf")

KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
SHAPES = [(3, 256), (5, 512)]
# the float32 rounding of the last add, in gguf's dequantization and in sgl's
F32 = 2.0 ** -24


def block_bytes(type_name: str) -> int:
    return gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]


def random_blocks(type_name: str, rows: int, cols: int, seed: int, *,
                  power_of_two: bool = False, q6_scales: np.ndarray | None = None) -> np.ndarray:
    """Random K-quant bytes ``[rows, cols / 256 * block]`` whose float16 ``d`` (and ``dmin``)
    are finite: 1e-5..1 in magnitude, either sign (some ``d sc`` land below float16's normal
    range), or powers of two; ``q6_scales``: Q6_K's 16 int8 scales instead of random ones."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, block_bytes(type_name)), dtype=np.uint8)
    if power_of_two:
        halves = 2.0 ** -rng.integers(4, 14, (rows, cols // 256, 2))
    else:
        halves = 10 ** rng.uniform(-5, 0, (rows, cols // 256, 2))
        halves[..., 1] = halves[..., 0] * rng.uniform(0.5, 2, (rows, cols // 256))
    halves *= rng.choice([-1, 1], halves.shape)
    halves = halves.astype(np.float16)
    if type_name == "Q6_K":
        blocks[..., 208:210] = halves[..., :1].view(np.uint8)
        if q6_scales is not None:
            blocks[..., 192:208] = q6_scales.astype(np.int8).view(np.uint8)
    else:
        blocks[..., 0:4] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


def reference(type_name: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(data, qtype).reshape(rows, cols).astype(np.float32)


def repacked(type_name: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    layout, qweight, scales = repack_gguf_blocks(type_name, data, rows, cols)
    assert layout == GGUF_QUANTIZED[type_name]
    return quant.dequantize(layout, qweight, scales).numpy()


def stated_bound(type_name: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Each value's bound from the module docstring, ``[rows, cols]``: Q4_K/Q5_K ``2^-11
    (qmax |d sc| + |dmin mn|)`` of its sub-block (``sc``, ``mn`` unpacked by ``gguf``), Q6_K
    0 (q6 holds it exactly)."""
    if type_name == "Q6_K":
        bound = np.zeros((rows, cols // 32))
    else:
        blocks = data.reshape(-1, block_bytes(type_name))
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        qmax = 15 if type_name == "Q4_K" else 31
        bound = 2.0 ** -11 * (qmax * np.abs(d * sc) + np.abs(dmin * mn))
    return np.repeat(bound.reshape(rows, -1), 32, axis=1)


def worst(type_name: str, data: np.ndarray, rows: int, cols: int,
          bound: np.ndarray | None = None) -> float:
    """The largest ``|sgl - gguf| / bound`` (float32 rounding aside); at most 1 passes."""
    want = reference(type_name, data, rows, cols).astype(np.float64)
    got = repacked(type_name, data, rows, cols).astype(np.float64)
    if bound is None:
        bound = stated_bound(type_name, data, rows, cols)
    err = np.abs(got - want) - F32 * (np.abs(got) + np.abs(want))
    return float(np.max(np.where(err <= 0, 0, err / np.maximum(bound, 1e-300))))


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("type_name", KQUANTS)
def test_random_blocks_are_within_the_stated_bound(type_name: str, rows: int, cols: int) -> None:
    for seed in range(4):
        data = random_blocks(type_name, rows, cols, seed)
        layout, qweight, scales = repack_gguf_blocks(type_name, data, rows, cols)
        assert layout == gguf_kquants.KQUANT_LAYOUTS[type_name]
        assert qweight.shape[:2] == scales.shape[:2] == (rows, cols // 32)
        assert worst(type_name, data, rows, cols) <= 1


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_q4_k_and_q5_k_are_exact_where_d_sc_and_dmin_mn_are_float16(type_name: str) -> None:
    """Powers of two for ``d`` and ``dmin``: nothing rounds, so the values are gguf's bit for
    bit; otherwise the rounding is there (the bound is not vacuous)."""
    data = random_blocks(type_name, 5, 512, 7, power_of_two=True)
    np.testing.assert_array_equal(repacked(type_name, data, 5, 512),
                                  reference(type_name, data, 5, 512))
    data = random_blocks(type_name, 5, 512, 7)
    assert not np.array_equal(repacked(type_name, data, 5, 512), reference(type_name, data, 5, 512))


def requantized(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A Q6_K tensor as the kernels without q6 get it: q8 blocks (:func:`quant.requantize_q6`)."""
    _, qweight, scales = repack_gguf_blocks("Q6_K", data, rows, cols)
    return quant.dequantize("q8", *quant.requantize_q6(qweight, scales, rows_per_step=2)).numpy()


def test_q6_k_is_held_exactly() -> None:
    """Q6_K's values bit for bit, also with d a power of two and every scale byte (-128)."""
    for seed, power_of_two in [(0, False), (1, True)]:
        data = random_blocks("Q6_K", 5, 512, seed, power_of_two=power_of_two)
        np.testing.assert_array_equal(repacked("Q6_K", data, 5, 512),
                                      reference("Q6_K", data, 5, 512))


def _q6_scales(kind: str, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "small":  # every s (q - 32) fits int8 as it is
        return rng.integers(-3, 5, (rows, blocks, 16))  # -32 * 4 = -128, -32 * -3 = 96
    same = rng.integers(-128, 128, (rows, blocks, 1))  # both halves of each block alike
    return np.repeat(same, 16, axis=-1)


@pytest.mark.parametrize("kind,power_of_two,exact", [
    ("small", False, True),   # c = power of two of gcd: d c is float16
    ("same", True, True),     # c = gcd = |s| gcd(q): d c is float16 (d a power of two)
    ("same", False, False),   # c = gcd with d c rounded: |err| <= 2^-11 max|W|
])
def test_q6_blocks_that_fit_int8_go_to_q8_exactly_or_round_only_d(kind: str,
                                                                   power_of_two: bool,
                                                                   exact: bool) -> None:
    rows, cols = 5, 512
    scales = _q6_scales(kind, rows, cols // 256, np.random.default_rng(3))
    data = random_blocks("Q6_K", rows, cols, 3, power_of_two=power_of_two, q6_scales=scales)
    got, want = requantized(data, rows, cols), reference("Q6_K", data, rows, cols)
    if exact:
        np.testing.assert_array_equal(got, want)
        return
    amax = np.abs(want).reshape(rows, -1, 32).max(-1)
    bound = np.repeat(amax * 2.0 ** -11, 32, axis=1)
    err = np.abs(got.astype(np.float64) - want) - F32 * (np.abs(got) + np.abs(want))
    assert (err <= bound).all()
    assert not np.array_equal(got, want)


def test_q6_blocks_of_real_files_are_requantized_to_q8_within_the_stated_bound() -> None:
    """Two different scales per 32 values, as llama.cpp writes them: most blocks are
    requantized, each to ``quantize``'s own q8 of the exact values, within ``(1 + 2^-10)
    max|W| / 254`` of its block."""
    data = random_blocks("Q6_K", 5, 512, 11)
    want = torch.from_numpy(reference("Q6_K", data, 5, 512))
    _, q6, s6 = repack_gguf_blocks("Q6_K", data, 5, 512)
    qweight, scales = quant.requantize_q6(q6, s6)
    amax = want.abs().reshape(5, -1, 32).amax(-1, keepdim=True)
    err = (quant.dequantize("q8", qweight, scales) - want).abs().reshape(5, -1, 32)
    assert (err <= amax * (1 + 2.0 ** -10) / 254 + F32 * amax).all()
    q_re, s_re = quant.quantize("q8", want)
    same = (qweight == q_re).all(-1) & (scales == s_re).all(-1)
    assert same.float().mean() > 0.9
    assert (scales[..., 1] == 0).all()


# -- the checks above fail on a wrong repack ---------------------------------------------------

def _wrong_scale_bits(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 with the top bits of scales 4-7 and mins 4-7 swapped."""
    lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    return (np.concatenate([lo & 63, (mix & 0x0F) | ((hi >> 6) << 4)], axis=-1),
            np.concatenate([hi & 63, (mix >> 4) | ((lo >> 6) << 4)], axis=-1))


def _interleaved_nibbles(qs: np.ndarray) -> np.ndarray:
    """Each byte read as two neighbouring values (Q4_0's order misread) instead of two
    sub-blocks."""
    rows, n = qs.shape[:2]
    return np.stack([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, n * 8, 32)


def _raw_q4_k_bytes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 128 bytes of nibbles taken as sgl's q4 bytes, unreordered."""
    rows, n = blocks.shape[:2]
    packed = np.ascontiguousarray(blocks[..., 16:144]).reshape(rows, n * 8, 16)
    return packed, gguf_kquants._sub_block_scales(blocks)


_q6_k_values = gguf_kquants._q6_k_values


def _q6_k_high_bits_misordered(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K with the 2-bit highs of values 32..63 and 64..95 of each 128 swapped."""
    swapped = blocks.copy()
    qh = swapped[..., 128:192]
    swapped[..., 128:192] = ((qh & 0x0C) << 2) | ((qh & 0x30) >> 2) | (qh & 0xC3)
    return _q6_k_values(swapped)


def _q6_k_scales_misordered(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K with the two scales of each 32 values swapped."""
    q, s, d = _q6_k_values(blocks)
    return q, s[..., ::-1], d


@pytest.mark.parametrize("type_name,name,wrong", [
    ("Q4_K", "_scales_and_mins", _wrong_scale_bits),
    ("Q5_K", "_scales_and_mins", _wrong_scale_bits),
    ("Q4_K", "_nibbles", _interleaved_nibbles),
    ("Q5_K", "_nibbles", _interleaved_nibbles),
    ("Q6_K", "_q6_k_values", _q6_k_high_bits_misordered),
    ("Q6_K", "_q6_k_values", _q6_k_scales_misordered),
])
def test_a_wrong_unpacking_fails_the_bound(monkeypatch: pytest.MonkeyPatch, type_name: str,
                                           name: str, wrong) -> None:
    data = random_blocks(type_name, 5, 512, 0)
    assert worst(type_name, data, 5, 512) <= 1
    monkeypatch.setattr(gguf_kquants, name, wrong)
    assert worst(type_name, data, 5, 512) > 1


def test_unreordered_q4_k_nibbles_fail_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_blocks("Q4_K", 5, 512, 0)
    monkeypatch.setitem(gguf_kquants._REPACK, "Q4_K", _raw_q4_k_bytes)
    assert worst("Q4_K", data, 5, 512) > 1


def test_swapped_q4_nibbles_and_shuffled_scales_fail_the_bound() -> None:
    data = random_blocks("Q4_K", 5, 512, 0)
    want = reference("Q4_K", data, 5, 512)
    bound = stated_bound("Q4_K", data, 5, 512)
    layout, qweight, scales = repack_gguf_blocks("Q4_K", data, 5, 512)
    for q, s in [((qweight >> 4) | (qweight << 4), scales),
                 (qweight, scales.roll(1, dims=1))]:
        err = np.abs(quant.dequantize(layout, q, s).numpy() - want)
        assert (err > bound).any()


# -- refusals and the loader ---------------------------------------------------------------------

@pytest.mark.parametrize("type_name,rows,cols,nbytes,message", [
    ("Q4_K", 1, 128, 72, "whole 256-value super-blocks"),
    ("Q6_K", 2, 256, 210, "takes 420 bytes, got 210"),
])
def test_repack_refuses_what_it_cannot_hold(type_name: str, rows: int, cols: int, nbytes: int,
                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        repack_gguf_blocks(type_name, np.zeros(nbytes, np.uint8), rows, cols)


def test_a_scale_beyond_float16_is_refused() -> None:
    data = random_blocks("Q4_K", 1, 256, 0).reshape(1, 1, -1)
    data[..., 0:2] = np.array([60000], np.float16).view(np.uint8)
    data[..., 4] = 63  # sc_0 = 63: d sc = 3.8e6
    with pytest.raises(ValueError, match="scale d \\* sc overflows float16"):
        repack_gguf_blocks("Q4_K", data, 1, 256)


HF_NAMES = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
            "attn_v": "self_attn.v_proj"}


def q3_k_blocks(rows: int, cols: int) -> np.ndarray:
    """Random Q3_K bytes (a K-quant sgl dequantizes) with a finite ``d`` (its last 2 bytes)."""
    blocks = np.random.default_rng(5).integers(0, 256, (rows, cols // 256, block_bytes("Q3_K")),
                                               dtype=np.uint8)
    blocks[..., -2:] = np.array([0.01], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    for name, (type_name, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_weights_keep_k_quant_blocks(tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """A file of K-quant projections (a Q3_K one among them) served quantized: the K-quants
    come as blocks equal to the repack, Q3_K is dequantized and the only type the log names."""
    types = {"ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "attn_v": "Q3_K"}
    tensors = {kind: (t, q3_k_blocks(4, 512) if t == "Q3_K" else random_blocks(t, 4, 512, i))
               for i, (kind, t) in enumerate(types.items())}
    path = tmp_path / "kquants.gguf"
    _write(path, {f"blk.0.{kind}.weight": value for kind, value in tensors.items()})
    with caplog.at_level(logging.WARNING, logger="sgl.model_loader.gguf_weights"):
        weights = GGUFWeights(path, torch.float32, quantized=True)
    assert weights.layouts == {"q4": 1, "q8": 1, "q6": 1, "dense": 1}
    assert "1 Q3_K tensor" in caplog.text
    assert not any(f"{t} tensor" in caplog.text for t in KQUANTS)
    got = dict(weights)
    for kind, (t, data) in tensors.items():
        weight = got[f"model.layers.0.{HF_NAMES[kind]}.weight"]
        if t == "Q3_K":
            assert isinstance(weight, torch.Tensor) and weight.shape == (4, 512)
            continue
        assert isinstance(weight, QuantizedTensor) and weight.layout == GGUF_QUANTIZED[t]
        np.testing.assert_array_equal(
            quant.dequantize(weight.layout, weight.qweight, weight.scales).numpy(),
            repacked(t, data, 4, 512))
