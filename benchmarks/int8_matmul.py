"""``sgl::linear_w8a8`` (int8 weights per channel, int8 activations per token) against sgl's
bfloat16 matmul, on the four projections of a decoder layer of a given shape (default
Llama-3.2-1B's: hidden 2048, intermediate 8192, 32 heads, 8 KV heads).

Two measurements, at the level this process runs (``SGL_CPU_ISA``), on ``--threads`` kernel
threads:

* **hot**: one layer's weights, called in a loop, so they stay in the caches: the kernels'
  arithmetic rate (GOP/s), bfloat16 and int8 side by side;
* **streaming**: ``--layers`` layers with weights of their own (int8), as a decode step reads
  them from memory: GB/s of weights read.

    .venv/bin/python benchmarks/int8_matmul.py
    .venv/bin/python benchmarks/int8_matmul.py --hidden 896 --intermediate 4864 --heads 14 \\
        --kv-heads 2 --rows 1,8,32
"""

from __future__ import annotations

import argparse
import sys

import torch
from roofline import _best_seconds as _best  # benchmarks/ is on the path when run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    p.add_argument("--layers", type=int, default=8, help="layers of the streaming measurement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    from sgl.kernels import cpu, ops

    if cpu.load() is None:
        p.error("sgl's CPU kernels are not loaded (sgl plugins says why)")
    torch.set_num_threads(1)
    cpu.set_threads(args.threads)
    h, head_dim = args.hidden, args.hidden // args.heads
    shapes = [(h + 2 * args.kv_heads * head_dim, h), (h, h), (2 * args.intermediate, h),
              (h, args.intermediate)]
    torch.manual_seed(0)

    def int8_layer() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        return [(ops.pack_int8_weight(torch.randint(-127, 128, (n, k), dtype=torch.int8)),
                 torch.rand(n) * 0.01, k) for n, k in shapes]

    hot = int8_layer()
    bf16 = [(ops.pack_bf16_weight((torch.randn(n, k) * 0.02).bfloat16()), n, k)
            for n, k in shapes]
    streaming = [w for _ in range(args.layers) for w in int8_layer()]
    layer_bytes = sum(n * k for n, k in shapes)
    print(f"{cpu.describe_isa()}, {args.threads} kernel thread(s); layer "
          f"{' '.join(f'{n}x{k}' for n, k in shapes)}")
    print("| rows | bf16 ms | int8 ms | int8 / bf16 speed | int8 GOP/s | bf16 GFLOP/s | "
          f"streaming {args.layers} layers ms | GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in shapes}}
        t_bf16 = _best(lambda: [torch.ops.sgl.linear_bf16(xs[k], w, n, None)
                                for w, n, k in bf16], args.reps)
        t_int8 = _best(lambda: [torch.ops.sgl.linear_w8a8(xs[k], w, s, None)
                                for w, s, k in hot], args.reps)
        t_stream = _best(lambda: [torch.ops.sgl.linear_w8a8(xs[k], w, s, None)
                                  for w, s, k in streaming], max(1, args.reps // 2))
        ops_count = 2 * m * layer_bytes
        print(f"| {m} | {t_bf16 * 1e3:.2f} | {t_int8 * 1e3:.2f} | {t_bf16 / t_int8:.2f}x | "
              f"{ops_count / t_int8 / 1e9:.0f} | {ops_count / t_bf16 / 1e9:.0f} | "
              f"{t_stream * 1e3:.1f} | {args.layers * layer_bytes / t_stream / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
