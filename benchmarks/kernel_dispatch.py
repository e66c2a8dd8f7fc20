"""What calling sgl's CPU kernels through torch's dispatcher costs, next to an eager decode step.

The kernels are torch operators (``torch.ops.sgl.*``, implemented by sgl-kernels-cpu). Every
call crosses Python -> torch's dispatcher -> the operator's C++ (argument checks, the output's
allocation) before the kernel runs. This measures, in one process, with SmolLM2-135M:

* **per call**: ``torch.ops.sgl.silu_mul`` on a 1 x 64 input (the kernel itself next to nothing)
  called eagerly, minus the same call replayed from a recorded tape of 1000 of them
  (``sgl_cpu::replay``: the kernel only, no Python, no dispatcher): the dispatch cost of one call;
* **eager decode step**: a decode step with the recorded-forward replay off
  (``--disable-cpu-graph``), its number of kernel calls, and the share the dispatch takes:
  ``calls x per-call cost / step``;
* **kernels only**: the same step's calls replayed from its tape, for scale::

    .venv/bin/python benchmarks/kernel_dispatch.py
    .venv/bin/python benchmarks/kernel_dispatch.py --dtypes bfloat16 --batch-sizes 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from decode_stages import Decoder, make_runner  # noqa: E402

from sgl.kernels import cpu  # noqa: E402
from sgl.plugins import create_plugin_manager  # noqa: E402


def per_call_us(reps: int) -> tuple[float, float]:
    """(eager call, replayed call) of ``sgl::silu_mul`` on one 64-wide row, in microseconds."""
    x = torch.randn(1, 128)
    op = torch.ops.sgl.silu_mul
    with cpu.recording() as tape:
        for _ in range(1000):
            op(x)
    eager, replayed = [], []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(1000):
            op(x)
        eager.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        tape.replay()
        replayed.append((time.perf_counter() - start) * 1e3)
    return statistics.median(eager), statistics.median(replayed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=96, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    p.add_argument("--reps", type=int, default=7, help="timed runs (the median is reported)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if cpu.load() is None:
        sys.exit(f"sgl's CPU kernels do not run here: {cpu.describe_isa()}")
    print(f"CPU kernels: {cpu.describe_isa()}; torch {torch.__version__}, 1 thread")
    eager, replayed = per_call_us(args.reps)
    dispatch = eager - replayed
    print(f"sgl::silu_mul [1, 128]: eager {eager:.2f} us/call, replayed {replayed:.2f} us/call: "
          f"dispatch {dispatch:.2f} us/call")
    pm = create_plugin_manager()
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            runner = make_runner(pm, dtype, batch, cpu_graphs=False)
            decoder = Decoder(runner, batch, args.context)
            decoder.run(2)  # warm-up
            with cpu.recording() as tape:
                decoder.run(1)
            steps, kernels_only = [], []
            for _ in range(args.reps):
                steps.append(decoder.run(args.steps))
                start = time.perf_counter()
                tape.replay()
                kernels_only.append(time.perf_counter() - start)
            step, kernel = statistics.median(steps), statistics.median(kernels_only)
            share = len(tape) * dispatch * 1e-6 / step
            print(f"{dtype:9s} batch {batch:3d}  eager step {step * 1e3:6.1f} ms, "
                  f"{len(tape)} kernel calls, dispatch {len(tape) * dispatch / 1e3:.2f} ms "
                  f"= {share:.1%} of the step; the kernels alone {kernel * 1e3:.1f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
