"""Decode with and without replaying recorded forwards (``sgl_kernels_cpu.graphs``), same run.

Runs the bundled SmolLM2-135M-Instruct in sgl's ``ModelRunner`` the way the scheduler does
(torch on one thread, sgl's kernels on ``--kernel-threads``), and decodes ``batch`` prompts of
32 tokens for ``--decode-tokens`` greedy tokens, once through the model's Python code (eager)
and once with the graph runner, alternating, ``--reps`` times; the median::

    .venv/bin/python benchmarks/cpu_graph.py --update-docs docs/benchmarks.md

The graph runs include the forward that is not recorded (the first of a batch size) and the one
that is recorded, as a server's would.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from model_throughput import (decode_prompts, load_sgl, machine, sgl_generate, update_docs,
                              use_threads)

DOCS_BEGIN = "<!-- cpu_graph:begin -->"
DOCS_END = "<!-- cpu_graph:end -->"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--kernel-threads", default="1,2",
                   help="comma-separated sizes of sgl's kernel thread pool")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--update-docs", metavar="PATH", default=None,
                   help=f"replace the text between {DOCS_BEGIN} and {DOCS_END} in PATH")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    from sgl.model_loader import bundled_model_path, load_tokenizer

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    threads = [int(t) for t in args.kernel_threads.split(",")]
    tokenizer = load_tokenizer(bundled_model_path())
    runner = load_sgl(args.dtype, max(batches), max(batches) * (32 + args.decode_tokens) + 64)
    graphs = runner.decode_graphs
    if graphs is None:
        raise SystemExit("sgl's CPU kernels are unavailable here: nothing to replay")
    rates: dict[tuple[int, int, str], list[float]] = {}
    same: dict[tuple[int, int], bool] = {}
    steps = [(n, b, rep) for n in threads for b in batches for rep in range(args.reps)]
    for n, b, rep in tqdm(steps, desc="decode", unit="case"):
        use_threads("sgl", n)
        prompts = decode_prompts(tokenizer, b, 32)
        modes = ["eager", "graph"] if rep % 2 == 0 else ["graph", "eager"]
        tokens = {}
        for mode in modes:
            runner.decode_graphs = graphs if mode == "graph" else None
            graphs.clear()  # every graph run records its batch size anew
            _, seconds, tokens[mode] = sgl_generate(runner, prompts, args.decode_tokens)
            rates.setdefault((n, b, mode), []).append(b * (args.decode_tokens - 1) / seconds)
        same[(n, b)] = same.get((n, b), True) and tokens["eager"] == tokens["graph"]
    lines = [f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/cpu_graph.py', *argv])}`",
             "", *[f"- {k}: {v}" for k, v in machine().items()],
             f"- {args.dtype}, prompts of 32 tokens, {args.decode_tokens} new tokens each; "
             f"tokens/s over the steps after the first token, median of {args.reps} runs", "",
             "| kernel threads | batch | eager tok/s | replayed tok/s | replayed / eager "
             "| same tokens |", "|---:|---:|---:|---:|---:|---|"]
    for n in threads:
        for b in batches:
            eager = statistics.median(rates[(n, b, "eager")])
            graph = statistics.median(rates[(n, b, "graph")])
            lines.append(f"| {n} | {b} | {eager:.1f} | {graph:.1f} | **{graph / eager:.2f}x** "
                         f"| {'yes' if same[(n, b)] else 'no'} |")
    text = "\n".join(lines)
    print(text)
    if args.update_docs:
        update_docs(Path(args.update_docs), text, DOCS_BEGIN, DOCS_END)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
