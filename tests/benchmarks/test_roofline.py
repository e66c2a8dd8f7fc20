"""benchmarks/roofline.py: the machine's limits and the fractions of them a cell reaches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import roofline  # noqa: E402
from roofline import Roofline  # noqa: E402

MACHINE = Roofline(threads=2, peak_gflops={"float32": 100.0, "bfloat16": 400.0, "int8": 800.0},
                   peak_by={}, bandwidth_gbs=20.0, bandwidth_by="sum", isa="test")


def test_decode_fraction_counts_the_weights_once_and_every_sequence_kv() -> None:
    # 2 GB of weights and 0.5 GB of KV per step, 8 steps/s: 20 GB/s, the whole bandwidth
    assert roofline.decode_fraction(2e9, 0.5e9, 8.0, MACHINE) == pytest.approx(1.0)
    assert roofline.decode_fraction(2e9, 0.0, 5.0, MACHINE) == pytest.approx(0.5)


def test_prefill_fraction_is_two_flops_per_parameter_and_token() -> None:
    # 1e9 parameters at 100 tokens/s: 200 GFLOP/s, half the bfloat16 peak
    assert roofline.prefill_fraction(1e9, 100.0, "bfloat16", MACHINE) == pytest.approx(0.5)
    assert roofline.prefill_fraction(1e9, 100.0, "float32", MACHINE) == pytest.approx(2.0)


def test_kv_bytes_per_token() -> None:
    # Llama-3.2-1B's cache in bfloat16: 16 layers, 8 KV heads of 64
    assert roofline.kv_bytes_per_token(16, 8, 64, 2) == 32768


def test_a_small_measurement_names_every_dtype_and_who_reached_it() -> None:
    measured = roofline.measure(threads=1, rows=16, reps=1, size=256, nbytes=2**22)
    assert set(measured.peak_gflops) == {"float32", "bfloat16", "int8"}
    assert all(rate > 0 for rate in measured.peak_gflops.values())
    assert set(measured.peak_by.values()) <= {"torch", "sgl"}
    assert measured.bandwidth_gbs > 0 and measured.threads == 1


def test_bad_arguments_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        roofline.main(["--threads", "0"])
    assert "--threads" in capsys.readouterr().err
