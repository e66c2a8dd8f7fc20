"""The matmuls of one SmolLM2-135M forward: sgl's kernels against torch's ``F.linear``.

Every linear layer's shape (30 layers: q, k, v, o, gate, up, down; then the LM head) for a
range of row counts, in float32 and bfloat16, and with the weights quantized (``q4``, ``q8``:
``sgl::linear_q4`` / ``linear_q8`` on float32 rows, torch on the dequantized float32 weight;
``q4x``, ``q8x``: the same with ``round_x``, the rows rounded to int8 per block; ``q4b``,
``q8b``: on bfloat16 rows, torch on the dequantized weight in bfloat16),
at the instruction-set level this process runs
(``SGL_CPU_ISA``; cap torch alike with ``MKL_ENABLE_INSTRUCTIONS`` and ``ONEDNN_MAX_CPU_ISA``).
Each side on 1 and on 2 threads (the kernels' own threads with torch on one; torch's threads);
best of ``--reps``, ms for the whole set. This is the measurement behind the row ranges of
``sgl_kernels_cpu.linear``.

By default the 30 layers share one weight of each shape, which then stays in the caches;
``--distinct-weights`` gives every layer its own, so that a set reads its weights from memory as
a model's forward does (270 MB in bfloat16).

    SGL_CPU_ISA=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/linear_kernels.py
    .venv/bin/python benchmarks/linear_kernels.py --dtypes bfloat16,q4,q8 --rows 1,8,32
    .venv/bin/python benchmarks/linear_kernels.py --dtypes bfloat16 --rows 1,8,32 --distinct-weights
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from sgl.kernels import cpu, quant

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]


def _best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,32,64,128,256,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated: float32, bfloat16, q4, q8, q4x, q8x, q4b, q8b")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--distinct-weights", action="store_true",
                        help="a weight per layer, read from memory, not one per shape")
    args = parser.parse_args()
    # the weight of matmul i of the set: its own with --distinct-weights, else its shape's
    keys = list(range(len(SHAPES))) if args.distinct_weights else SHAPES
    rounded = {f"{fmt}x": fmt for fmt in quant.FORMATS}
    bf16_rows = {f"{fmt}b": fmt for fmt in quant.FORMATS}
    unknown = set(args.dtypes.split(",")) - {"float32", "bfloat16", *quant.FORMATS, *rounded,
                                             *bf16_rows}
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(sorted(unknown))} (float32, bfloat16, "
                     f"{', '.join([*quant.FORMATS, *rounded, *bf16_rows])})")
    kernels = cpu.load()
    if kernels is None:
        print(f"no kernel library at this level: {cpu.describe_isa()}", file=sys.stderr)
        return 1
    print(f"level {cpu.describe_isa()}; ms for {len(SHAPES)} matmuls"
          + (", every weight its own" if args.distinct_weights else ""))
    for name in args.dtypes.split(","):
        weights = {}
        if name in quant.FORMATS or name in rounded or name in bf16_rows:
            dtype = torch.bfloat16 if name in bf16_rows else torch.float32
            fmt = rounded.get(name, bf16_rows.get(name, name))
            quantized = {"q4": torch.ops.sgl.linear_q4, "q8": torch.ops.sgl.linear_q8}[fmt]
            for key, (n, k) in dict(zip(keys, SHAPES)).items():
                packed = quant.quantize(fmt, torch.randn(n, k))
                weights[key] = (quant.dequantize(fmt, *packed).to(dtype), packed)

            def op(x, packed, n, bias, quantized=quantized, round_x=name in rounded):
                return quantized(x, *packed, bias, round_x)
        else:
            dtype = getattr(torch, name)
            pack = cpu.pack_bf16_weight if dtype == torch.bfloat16 else cpu.pack_f32_weight
            op = torch.ops.sgl.linear_bf16 if dtype == torch.bfloat16 else torch.ops.sgl.linear_f32
            for key, (n, k) in dict(zip(keys, SHAPES)).items():
                w = torch.randn(n, k).to(dtype)
                weights[key] = (w, pack(w))
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
            cells = []
            for threads in (1, 2):
                torch.set_num_threads(1)
                cpu.set_threads(threads)
                mine = _best_ms(lambda: [op(xs[k], weights[key][1], n, None)
                                         for key, (n, k) in zip(keys, SHAPES)], args.reps)
                cpu.set_threads(1)
                torch.set_num_threads(threads)
                theirs = _best_ms(lambda: [F.linear(xs[k], weights[key][0])
                                           for key, (n, k) in zip(keys, SHAPES)], args.reps)
                cells.append(f"{threads} thr: kernel {mine:8.1f} torch {theirs:8.1f}")
            print(f"{name:9} rows {rows:5}  " + " | ".join(cells), flush=True)
    torch.set_num_threads(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
