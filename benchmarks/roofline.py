"""This machine's limits, which every benchmark table is read against: the matmul peak of each
dtype and the memory bandwidth, and the fraction of them a measured cell reaches.

    .venv/bin/python benchmarks/roofline.py                 # print this machine's roofline
    .venv/bin/python benchmarks/roofline.py --threads 1 --json roofline.json

* **Matmul peak** per dtype: GFLOP/s (GOP/s for int8) of a ``--rows`` x 4096 by 4096 x 4096
  product, the best of torch's operator (oneDNN / MKL; ``torch._int_mm`` for int8 x int8 -> int32)
  and sgl's own kernels (``sgl::linear_f32``, ``linear_bf16``; ``linear_q8`` with the rows
  rounded to int8 for int8), each on ``--threads`` threads, best of ``--reps``. A matmul this
  size runs at the rate of the multiply units, not of memory.
* **Memory bandwidth**: GB/s of reading a 1 GiB float32 tensor (a sum over it) and of sgl's
  bfloat16 matmul of one row against 1 GiB of distinct weights, the way a decode step reads a
  model; the larger of the two is the roofline.

A decode step reads every weight once and each sequence's KV cache, so its floor is
``(weight bytes + KV bytes) / bandwidth``; a prefill does ``2 x parameters x tokens`` FLOPs, so
its floor is that over the matmul peak. :func:`decode_fraction` and :func:`prefill_fraction` turn
a measured rate into the fraction of the floor it reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

#: the side of the square weight of the peak matmuls: 32 MiB in bfloat16, larger than the
#: caches, and large enough that every kernel runs at its steady rate
PEAK_K = 4096
#: bytes read by the bandwidth measurements
BANDWIDTH_BYTES = 2**30


@dataclass(frozen=True)
class Roofline:
    """A machine's measured limits on ``threads`` threads."""

    threads: int
    #: GFLOP/s of float32 and bfloat16 matmuls; GOP/s of int8 x int8 -> int32
    peak_gflops: dict[str, float]
    #: which side reached each peak: ``torch`` or ``sgl``
    peak_by: dict[str, str]
    #: GB/s read from memory
    bandwidth_gbs: float
    bandwidth_by: str
    isa: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _on_threads(side: str, threads: int) -> None:
    """torch's threads for torch's operators; sgl's kernels run on their own pool while torch
    has one thread, as in the server."""
    from sgl.kernels import cpu

    if side == "torch":
        cpu.set_threads(1)
        torch.set_num_threads(threads)
    else:
        torch.set_num_threads(1)
        cpu.set_threads(threads)


def _matmul_candidates(rows: int, size: int) -> dict[str, dict[str, Callable[[], object]]]:
    """For each dtype, the products to time (``rows`` x ``size`` by ``size`` x ``size``), by
    who computes them."""
    from sgl.kernels import cpu, quant

    out: dict[str, dict[str, Callable[[], object]]] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        x = torch.randn(rows, size).to(dtype)
        w = torch.randn(size, size).to(dtype)
        out[name] = {"torch": lambda x=x, w=w: torch.nn.functional.linear(x, w)}
        if cpu.load() is not None:
            pack = cpu.pack_bf16_weight if dtype == torch.bfloat16 else cpu.pack_f32_weight
            op = torch.ops.sgl.linear_bf16 if dtype == torch.bfloat16 else torch.ops.sgl.linear_f32
            packed = pack(w)
            out[name]["sgl"] = lambda x=x, op=op, packed=packed: op(x, packed, size, None)
    xi = torch.randint(-127, 128, (rows, size), dtype=torch.int8)
    wi = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    out["int8"] = {"torch": lambda: torch._int_mm(xi, wi)}
    if cpu.load() is not None:
        packed = quant.quantize("q8", torch.randn(size, size))
        xf = torch.randn(rows, size)
        out["int8"]["sgl"] = lambda: torch.ops.sgl.linear_q8(xf, *packed, None, True)
    return out


def measure_peaks(threads: int, rows: int = 1024, reps: int = 5, size: int = PEAK_K
                  ) -> tuple[dict[str, float], dict[str, str]]:
    """The best GFLOP/s (GOP/s for int8) of each dtype and who reached it."""
    flops = 2.0 * rows * size * size
    peaks: dict[str, float] = {}
    by: dict[str, str] = {}
    for name, sides in _matmul_candidates(rows, size).items():
        for side, fn in sides.items():
            _on_threads(side, threads)
            rate = flops / _best_seconds(fn, reps) / 1e9
            if rate > peaks.get(name, 0.0):
                peaks[name], by[name] = round(rate, 1), side
    return peaks, by


def measure_bandwidth(threads: int, reps: int = 5, nbytes: int = BANDWIDTH_BYTES,
                      size: int = PEAK_K) -> tuple[float, str]:
    """The best GB/s of reading ``nbytes`` from memory, and how it was read."""
    from sgl.kernels import cpu

    _on_threads("torch", threads)
    data = torch.ones(nbytes // 4)
    best, how = nbytes / _best_seconds(data.sum, reps) / 1e9, "sum"
    del data
    if cpu.load() is not None:
        _on_threads("sgl", threads)
        count = max(1, nbytes // (size * size * 2))
        packed = [cpu.pack_bf16_weight(torch.randn(size, size).to(torch.bfloat16))
                  for _ in range(count)]
        x = torch.randn(1, size).to(torch.bfloat16)

        def decode() -> None:
            for p in packed:
                torch.ops.sgl.linear_bf16(x, p, size, None)

        rate = count * size * size * 2 / _best_seconds(decode, reps) / 1e9
        if rate > best:
            best, how = rate, "sgl bfloat16 matmul of one row"
    return round(best, 1), how


def measure(threads: int | None = None, rows: int = 1024, reps: int = 5, size: int = PEAK_K,
            nbytes: int = BANDWIDTH_BYTES) -> Roofline:
    """This machine's roofline on ``threads`` threads (default: the usable cores); ``size`` and
    ``nbytes`` shrink the measurements (for tests: the numbers then say little)."""
    from sgl.kernels import cpu
    from sgl.threads import usable_cores

    threads = threads or usable_cores()
    before = torch.get_num_threads()
    try:
        peaks, by = measure_peaks(threads, rows, reps, size)
        bandwidth, how = measure_bandwidth(threads, reps, nbytes, size)
    finally:
        torch.set_num_threads(before)
    return Roofline(threads=threads, peak_gflops=peaks, peak_by=by, bandwidth_gbs=bandwidth,
                    bandwidth_by=how, isa=cpu.describe_isa())


def decode_fraction(weight_bytes: float, kv_bytes_per_step: float, steps_per_second: float,
                    roofline: Roofline) -> float:
    """The fraction of the memory bandwidth a decode reaches: every step reads the weights once
    and the KV cache of each sequence in the batch."""
    return (weight_bytes + kv_bytes_per_step) * steps_per_second / 1e9 / roofline.bandwidth_gbs


def prefill_fraction(parameters: float, tokens_per_second: float, dtype: str,
                     roofline: Roofline) -> float:
    """The fraction of the ``dtype`` matmul peak a prefill reaches (2 FLOPs per parameter and
    token; attention's own FLOPs left out, which only makes the fraction an underestimate)."""
    return 2.0 * parameters * tokens_per_second / 1e9 / roofline.peak_gflops[dtype]


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V one token keeps in every layer's cache."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of every measurement (default: the usable cores)")
    parser.add_argument("--rows", type=int, default=1024, help="rows of the peak matmuls")
    parser.add_argument("--reps", type=int, default=5, help="runs of each; the best counts")
    parser.add_argument("--json", help="also write the roofline here")
    args = parser.parse_args(argv)
    if args.threads is not None and not 1 <= args.threads <= (os.cpu_count() or 1):
        parser.error(f"--threads: expected 1-{os.cpu_count()}, got {args.threads}")
    if args.rows < 1 or args.reps < 1:
        parser.error("--rows and --reps: expected positive integers")
    roofline = measure(args.threads, args.rows, args.reps)
    print(f"roofline on {roofline.threads} thread(s), sgl's kernels at {roofline.isa}")
    for name, rate in roofline.peak_gflops.items():
        unit = "GOP/s" if name == "int8" else "GFLOP/s"
        print(f"  {name:9} matmul peak {rate:9.1f} {unit}  ({roofline.peak_by[name]})")
    print(f"  memory bandwidth  {roofline.bandwidth_gbs:9.1f} GB/s     ({roofline.bandwidth_by})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(roofline.to_dict(), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
