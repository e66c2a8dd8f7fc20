"""One layer of prefill attention: ``sgl::extend_attention``'s kernel against torch's SDPA.

The shape of SmolLM2-135M (9 query heads, 3 KV heads, 64 wide) over one prompt of ``--tokens``
new tokens with no cached prefix, at the instruction-set level this process runs
(``SGL_CPU_ISA`` caps it; cap torch alike with ``ATEN_CPU_CAPABILITY``,
``MKL_ENABLE_INSTRUCTIONS`` and ``ONEDNN_MAX_CPU_ISA`` to stand in for a smaller CPU: SDPA's
products are MKL's). The kernel runs on 1 and 2 of its own
threads, SDPA on one torch thread, as the scheduler runs them; median of ``--reps``, ms. This is
the measurement behind ``CpuKernelLibrary.extend_attention_faster``.

    .venv/bin/python benchmarks/extend_attention.py
    .venv/bin/python benchmarks/extend_attention.py --running 28 --prompts 4 --tokens 128
    SGL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/extend_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from sgl.kernels import cpu


def median_ms(fn, reps: int) -> float:
    """The median time of ``reps`` calls of ``fn`` after one warm-up call, ms."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def mixed_step(args: argparse.Namespace) -> None:
    """A mixed step, ``--running`` requests of one new token at ``--context`` then ``--prompts``
    prompts of ``--tokens``, on 2 kernel threads: all of it in one extend call, against the
    running requests in one decode call and the prompts in one extend call (what the torch
    backend does)."""
    hq, hk, d, r, c = args.heads, args.kv_heads, args.head_dim, args.running, args.context
    items = [(c, 1)] * r + [(0, args.tokens)] * args.prompts  # (prefix, new tokens)
    slots = torch.randperm(sum(p + n for p, n in items))  # the pool's order is no sequence's
    table = torch.zeros(len(items), max(p + n for p, n in items), dtype=torch.long)
    used = 0
    for i, (p, n) in enumerate(items):
        table[i, :p + n] = slots[used:used + p + n]
        used += p + n
    rows = torch.arange(len(items))
    new = torch.tensor([n for _, n in items])
    starts, prefix = new.cumsum(0) - new, torch.tensor([p for p, _ in items])
    cpu.set_threads(2)
    print(f"mixed step, 2 kernel threads: {r} running at context {c}, {args.prompts} prompts of "
          f"{args.tokens}")
    print("dtype     one extend call  decode + extend   (ms)")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        q = torch.randn(int(new.sum()), hq * d).to(dtype)
        k_pool, v_pool = torch.randn(used, hk, d).to(dtype), torch.randn(used, hk, d).to(dtype)
        loc = table[:r, c].contiguous()
        k_new, v_new = k_pool[loc].view(r, -1), v_pool[loc].view(r, -1)

        def extend(b0: int) -> torch.Tensor:
            return torch.ops.sgl.extend_attention(q, k_pool, v_pool, table, rows[b0:],
                                                  starts[b0:], prefix[b0:], new[b0:], hq, hk, d,
                                                  d ** -0.5, 0.0, 0)

        def split() -> torch.Tensor:
            out = extend(r)
            out[:r] = torch.ops.sgl.decode_attention(q[:r], k_new, v_new, k_pool, v_pool, table,
                                                     rows[:r], prefix[:r] + 1, loc, hq,
                                                     hk, d, d ** -0.5, 0.0, 0)
            return out

        torch.testing.assert_close(split().float(), extend(0).float(), rtol=0.02, atol=0.02)
        times = [median_ms(lambda: extend(0), args.reps), median_ms(split, args.reps)]
        print(f"{str(dtype).split('.')[1]:9} " + "  ".join(f"{t:15.2f}" for t in times))
    cpu.set_threads(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--running", type=int, default=0,
                        help="time a mixed step instead: this many requests of one new token "
                             "each, then --prompts prompts of --tokens")
    parser.add_argument("--context", type=int, default=200,
                        help="cached tokens of each running request (with --running)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of a mixed step")
    args = parser.parse_args()
    kernels = cpu.load()
    if kernels is None:
        print(f"no kernel library at this level: {cpu.describe_isa()}", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    if args.running:
        mixed_step(args)
        return 0
    n, hq, hk, d = args.tokens, args.heads, args.kv_heads, args.head_dim
    print(f"level {cpu.describe_isa()}; {n} tokens, {hq} heads, {hk} KV heads of {d}")
    print("dtype     kernel 1 thr  kernel 2 thr  SDPA 1 thr   (ms)")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        q = torch.randn(n, hq * d).to(dtype)
        k_pool, v_pool = torch.randn(n, hk, d).to(dtype), torch.randn(n, hk, d).to(dtype)
        table = torch.arange(n).view(1, n)
        zero, length = torch.zeros(1, dtype=torch.long), torch.tensor([n])

        def kernel() -> torch.Tensor:
            return torch.ops.sgl.extend_attention(q, k_pool, v_pool, table, zero, zero, zero,
                                                  length, hq, hk, d, d ** -0.5, 0.0, 0)

        qs = q.view(1, n, hq, d).transpose(1, 2)
        ks, vs = k_pool.view(1, n, hk, d).transpose(1, 2), v_pool.view(1, n, hk, d).transpose(1, 2)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=d ** -0.5,
                                                  enable_gqa=True)

        expected = sdpa().transpose(1, 2).reshape(n, hq * d).float()
        times = []
        for threads in (1, 2):
            cpu.set_threads(threads)
            torch.testing.assert_close(kernel().float(), expected, rtol=0.02, atol=0.02)
            times.append(median_ms(kernel, args.reps))
        cpu.set_threads(1)
        times.append(median_ms(sdpa, args.reps))
        print(f"{str(dtype).split('.')[1]:9} " + "  ".join(f"{t:12.1f}" for t in times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
