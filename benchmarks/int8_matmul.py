"""sgl's quantized matmuls against its bfloat16 matmul, on the four projections of a decoder
layer of a given shape (default Llama-3.2-1B's: hidden 2048, intermediate 8192, 32 heads, 8 KV
heads).

The kinds (``--kinds``): ``bf16`` (``sgl::linear_bf16``, the baseline), ``w8a8``
(``sgl::linear_w8a8``: int8 weights per channel, int8 activations per token), ``q4`` and ``q8``
(``sgl::linear_q4`` / ``linear_q8``: GGUF-style blocks of 32 with bfloat16 activations, exact),
``q4x`` and ``q8x`` (the same with ``round_x``: activations rounded per block to int8, as
llama.cpp multiplies), ``q4x16``, ``q8x16`` and ``q6x16`` (``round_x`` on the weight packed in
the x16 layout, ``sgl::linear_qx16``: what a GGUF model's layers hold where the CPU has
AVX512-VNNI; q6 is GGUF's ``Q6_K``, random blocks).

Two measurements, at the level this process runs (``SGL_CPU_ISA``), on ``--threads`` kernel
threads:

* **hot**: one layer's weights, called in a loop, so they stay in the caches: the kernels'
  arithmetic rate (GOP/s) and the speed against ``bf16``;
* **streaming**: ``--layers`` layers with weights of their own, as a decode step reads them from
  memory: GB/s of stored weight bytes read.

    .venv/bin/python benchmarks/int8_matmul.py
    .venv/bin/python benchmarks/int8_matmul.py --kinds bf16,q4,q4x,q8,q8x --rows 1,8,32,128
    .venv/bin/python benchmarks/int8_matmul.py --hidden 896 --intermediate 4864 --heads 14 \\
        --kv-heads 2 --rows 1,8,32
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from roofline import _best_seconds as _best  # benchmarks/ is on the path when run

KINDS = ("bf16", "w8a8", "q4", "q8", "q4x", "q8x", "q4x16", "q8x16", "q6x16")


def _layer(kind: str, shapes: list[tuple[int, int]]) -> list[tuple[Callable, int]]:
    """One layer's weights of ``kind``: (multiply ``x``, stored bytes) per projection."""
    from sgl.kernels import ops, quant

    out = []
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        if kind == "bf16":
            packed = ops.pack_bf16_weight(w.bfloat16())
            out.append((lambda x, p=packed, n=n: torch.ops.sgl.linear_bf16(x, p, n, None),
                        packed.numel() * 2))
        elif kind == "w8a8":
            packed = ops.pack_int8_weight(torch.randint(-127, 128, (n, k), dtype=torch.int8))
            scale = torch.rand(n) * 0.01
            out.append((lambda x, p=packed, s=scale: torch.ops.sgl.linear_w8a8(x, p, s, None),
                        packed.numel()))
        elif kind == "q6x16":  # random Q6_K-style blocks: any q, s; small d
            qweight = torch.randint(0, 256, (n, k // 32, 26), dtype=torch.uint8)
            scales = torch.zeros(n, k // 32, 2, dtype=torch.float16)
            scales[..., 0] = torch.rand(n, k // 32) * 1e-4
            packed = quant.pack_x16("q6", qweight, scales)
            out.append((lambda x, p=packed: torch.ops.sgl.linear_qx16(x, p, 6, None),
                        packed.numel()))
        elif kind.endswith("x16"):
            fmt = kind[:2]
            packed = quant.pack_x16(fmt, *quant.quantize(fmt, w))
            out.append((lambda x, p=packed, b=int(fmt[1]): torch.ops.sgl.linear_qx16(x, p, b, None),
                        packed.numel()))
        else:
            fmt, round_x = kind[:2], kind.endswith("x")
            qweight, scales = quant.quantize(fmt, w)
            op = getattr(torch.ops.sgl, f"linear_{fmt}")
            out.append((lambda x, q=qweight, s=scales, op=op: op(x, q, s, None, round_x),
                        qweight.numel() + scales.numel() * 2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="bf16,w8a8",
                   help=f"comma-separated, the first is the baseline; of {', '.join(KINDS)}")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    p.add_argument("--layers", type=int, default=8, help="layers of the streaming measurement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds: unknown {', '.join(bad)} (known: {', '.join(KINDS)})")
    from sgl.kernels import cpu

    if cpu.load() is None:
        p.error("sgl's CPU kernels are not loaded (sgl plugins says why)")
    torch.set_num_threads(1)
    cpu.set_threads(args.threads)
    h, head_dim = args.hidden, args.hidden // args.heads
    shapes = [(h + 2 * args.kv_heads * head_dim, h), (h, h), (2 * args.intermediate, h),
              (h, args.intermediate)]
    torch.manual_seed(0)
    hot = {kind: _layer(kind, shapes) for kind in kinds}
    streaming = {kind: [w for _ in range(args.layers) for w in _layer(kind, shapes)]
                 for kind in kinds[1:]}
    macs = sum(n * k for n, k in shapes)
    print(f"{cpu.describe_isa()}, {args.threads} kernel thread(s); layer "
          f"{' '.join(f'{n}x{k}' for n, k in shapes)}")
    print(f"| rows | kind | ms | speed vs {kinds[0]} | GOP/s | streaming {args.layers} layers "
          "ms | GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in shapes}}
        base = None
        for kind in kinds:
            layer = list(zip(hot[kind], shapes))
            t = _best(lambda: [f(xs[k]) for (f, _), (_, k) in layer], args.reps)
            base = base or t
            stream = ""
            if kind in streaming:
                layers = list(zip(streaming[kind], shapes * args.layers))
                ts = _best(lambda: [f(xs[k]) for (f, _), (_, k) in layers],
                           max(1, args.reps // 2))
                size = sum(b for _, b in streaming[kind])
                stream = f"{ts * 1e3:.1f} | {size / ts / 1e9:.1f}"
            else:
                stream = "- | -"
            print(f"| {m} | {kind} | {t * 1e3:.2f} | {base / t:.2f}x | "
                  f"{2 * m * macs / t / 1e9:.0f} | {stream} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
