"""One layer of decode attention: ``sgl::decode_attention``'s kernel against its torch reference.

The shape of SmolLM2-135M (9 query heads, 3 KV heads, 64 wide): ``--batch`` sequences of
``--context`` cached tokens each take one new token, at the instruction-set level this process
runs (``SGL_CPU_ISA`` caps it). The sequences' slots are scattered over a pool four times their
size, as a server's pool is after a while (``--contiguous`` lays them out in order). The kernel
runs on 1 and 2 of its own threads; median of ``--reps``, ms, and the bytes of K and V read per
second at that time.

One layer's K and V fit in the caches at small sizes (batch 32, context 200: 5 MB), which a
server's step never sees. ``--layers 30`` gives each of 30 layers its own pool and times them one
after another, as one decode step of SmolLM2 does: 150 MB of K and V, read from memory.

    .venv/bin/python benchmarks/decode_attention.py --batch 1,32 --context 200,1000
    .venv/bin/python benchmarks/decode_attention.py --batch 32 --context 200 --layers 30
    .venv/bin/python benchmarks/decode_attention.py --batch 32 --context 640 --layers 30 \
        --contiguous --shared-prefix 512   # groups of 16 sequences share a system prompt
    SGL_CPU_ISA=avx2 .venv/bin/python benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import sys

import torch

from extend_attention import median_ms
from sgl.kernels import cpu
from sgl.kernels import ops


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=_ints, default=[1, 32], help="comma-separated batch sizes")
    parser.add_argument("--context", type=_ints, default=[200, 1000],
                        help="comma-separated cached tokens per sequence")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of one step, each with its own pool, timed together")
    parser.add_argument("--contiguous", action="store_true",
                        help="each sequence's slots in order, not scattered over the pool")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="the first N slots of each sequence are those of its group's first "
                             "sequence (a system prompt the prefix cache shares)")
    parser.add_argument("--group", type=int, default=16,
                        help="sequences per group with --shared-prefix")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    kernels = cpu.load()
    if kernels is None:
        print(f"no kernel library at this level: {cpu.describe_isa()}", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    hq, hk, d = args.heads, args.kv_heads, args.head_dim
    print(f"level {cpu.describe_isa()}; {hq} heads, {hk} KV heads of {d}; "
          f"{'contiguous' if args.contiguous else 'scattered'} slots; {args.layers} layer(s)"
          + (f"; groups of {args.group} share {args.shared_prefix} slots" if args.shared_prefix
             else ""))
    print("dtype     batch  context  kernel 1 thr (GB/s)   kernel 2 thr (GB/s)   (ms)")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for batch in args.batch:
            for context in args.context:
                torch.manual_seed(0)
                size = batch * (context + 1)
                pool = 4 * size
                pools = [(torch.randn(pool, hk, d).to(dtype), torch.randn(pool, hk, d).to(dtype))
                         for _ in range(args.layers)]
                slots = torch.arange(size) if args.contiguous else torch.randperm(pool)[:size]
                table = slots.view(batch, context + 1).clone()
                if args.shared_prefix:  # each group's sequences use their first one's prefix
                    first = torch.arange(batch) // args.group * args.group
                    table[:, :args.shared_prefix] = table[first, :args.shared_prefix]
                rows = torch.arange(batch)
                lens = torch.full((batch,), context + 1)
                loc = table[:, context].contiguous()
                q = torch.randn(batch, hq * d).to(dtype)
                k, v = torch.randn(batch, hk * d).to(dtype), torch.randn(batch, hk * d).to(dtype)
                rest = (table, rows, lens, loc, hq, hk, d, d ** -0.5, 0.0, 0)
                k_pool, v_pool = pools[0]
                expected = ops.decode_attention(q, k, v, k_pool.clone(), v_pool.clone(),
                                                *rest).float()

                def step() -> None:  # every layer's attention, one after another
                    for k_pool, v_pool in pools:
                        torch.ops.sgl.decode_attention(q, k, v, k_pool, v_pool, *rest)

                read = table.unique().numel()  # the K and V rows the kernel needs
                nbytes = 2 * read * hk * d * k_pool.element_size() * args.layers
                cells = []
                for threads in (1, 2):
                    cpu.set_threads(threads)
                    out = torch.ops.sgl.decode_attention(q, k, v, k_pool, v_pool, *rest)
                    torch.testing.assert_close(out.float(), expected, rtol=0.02, atol=0.02)
                    ms = median_ms(step, args.reps)
                    cells.append(f"{ms:9.3f} ({nbytes / ms / 1e6:5.1f})")
                cpu.set_threads(1)
                print(f"{dtype_name:9} {batch:5} {context:8}  " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
