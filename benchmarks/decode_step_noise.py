"""A decode step of a loaded model next to the noise a served step runs in, in one process.

    .venv/bin/python benchmarks/decode_step_noise.py [--model-path DIR] [--batch 32]
        [--context 200] [--busy-ms 0.3 --idle-ms 2.0] [--rounds 6]

A served decode step shares the CPU with the HTTP process and the benchmark client (about 13%
of one core at concurrency 32 on two cores), and took its logits in a new float32 tensor. Each
round times ``--steps`` decode steps of ``--batch`` sequences in four ways, interleaved:

* ``quiet``: the step as the scheduler runs it (logits in the runner's kept buffer);
* ``new logits``: the logits in a new tensor each step, as before (``logits_at`` without
  ``reuse``); the page faults of the step are counted;
* ``busy``: with a process that spins ``--busy-ms`` and sleeps ``--idle-ms``;
* ``busy, new logits``: both.

Medians over all rounds, ms per step. The kernel threads are those the server would start with.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.engine.model_runner import ModelRunner
from sgl.engine.setup import configure_threads
from sgl.forward_batch import ForwardMode
from sgl.kernels import cpu
from sgl.plugins import create_plugin_manager

BUSY = """
import sys, time
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
"""


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=15, help="decode steps per round and way")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--busy-ms", type=float, default=0.3)
    parser.add_argument("--idle-ms", type=float, default=2.0)
    args = parser.parse_args()
    pm = create_plugin_manager()
    cpu.use_plugins(pm)
    plan = configure_threads(None, None)
    kwargs = {} if args.model_path else {"quantization": "none"}
    runner = ModelRunner(model_path=args.model_path, dtype=args.dtype, registries=pm.registries,
                         plugin_manager=pm, max_running_requests=args.batch,
                         max_total_tokens=args.batch * (args.context + args.steps + 8) + 64,
                         show_progress=False, **kwargs)
    print(f"{plan}; kernels {cpu.describe_isa()}; batch {args.batch}, context {args.context}")
    gen = torch.Generator().manual_seed(0)
    rows = [runner.req_to_token_pool.alloc() for _ in range(args.batch)]
    for row in rows:
        prompt = torch.randint(1000, 40000, (args.context,), generator=gen).tolist()
        runner.forward_logits(make_forward_batch(runner, ForwardMode.EXTEND,
                                                 [BatchSeq(row, 0, prompt)]))
    table = runner.req_to_token_pool.req_to_token
    everyone = torch.arange(args.batch)

    def steps(reuse: bool) -> tuple[list[float], int]:
        ids, lens, times, before = [5] * args.batch, [args.context] * args.batch, [], faults()
        for _ in range(args.steps):
            start = time.perf_counter()
            batch = make_forward_batch(runner, ForwardMode.DECODE, [
                BatchSeq(r, n, [t]) for r, n, t in zip(rows, lens, ids)])
            logits = runner.logits_at(runner.forward(batch), everyone, reuse=reuse)
            ids = cpu.argmax_rows(logits).tolist()
            times.append((time.perf_counter() - start) * 1e3)
            lens = [n + 1 for n in lens]
        for row, n in zip(rows, lens):  # the decoded tokens' slots back
            runner.kv_pool.free(table[row, args.context:n].clone())
        return times, faults() - before

    steps(True)  # warm: the batch size recorded for replay
    steps(True)
    ways = ["quiet", "new logits", "busy", "busy, new logits"]
    times: dict[str, list[float]] = {w: [] for w in ways}
    paged: dict[str, int] = dict.fromkeys(ways, 0)
    for _ in range(args.rounds):
        for way in ways:
            busy = None
            if way.startswith("busy"):
                busy = subprocess.Popen([sys.executable, "-c", BUSY, str(args.busy_ms),
                                         str(args.idle_ms)])
                time.sleep(0.2)
            try:
                got, n = steps(reuse="new logits" not in way)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            times[way] += got
            paged[way] += n
    quiet = statistics.median(times["quiet"])
    print(f"{'way':18} {'ms/step':>8} {'x quiet':>8} {'faults/step':>12}")
    for way in ways:
        ms = statistics.median(times[way])
        print(f"{way:18} {ms:8.1f} {ms / quiet:8.2f} {paged[way] / len(times[way]):12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
