"""The frontend language's ``run_batch`` with and without the prefix cache, in one run.

    .venv/bin/python benchmarks/lang_run_batch.py [--update-docs docs/benchmarks.md]

32 few-shot QA programs (``--programs``) share a few-shot prompt of about 800 tokens (``--shots``
question/answer pairs) and each asks its own question, greedy, ``--max-tokens`` tokens with a
newline stop. The same batch runs through ``program.run_batch`` on two real ``sgl serve``
processes, one after the other: one with the radix cache (the default) and one with
``--disable-radix-cache``. On the cached server it runs twice: with the traced prefix sent once
as a warm-up (the default) and with ``warmup=False``. Every run uses a fresh prefix (a run number
in its first line) so nothing is left in the cache from the run before; the median of ``--reps``
is reported. Each server answers one warm-up request before its runs are timed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

BEGIN, END = "<!-- lang_run_batch:begin -->", "<!-- lang_run_batch:end -->"

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima"),
            ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Cuba", "Havana")]


@dataclass
class Run:
    seconds: float
    prompt_tokens: int
    cached_tokens: int


def few_shot_prompt(run: int, shots: int) -> str:
    lines = [f"Run {run}. Answer each question with one word or number."]
    for i in range(shots):
        country, capital = CAPITALS[i % len(CAPITALS)]
        a, b = 3 * i + 1, 7 * i + 2
        lines.append(f"Q: What is the capital of {country}?\nA: {capital}")
        lines.append(f"Q: What is {a} plus {b}?\nA: {a + b}")
    return "\n".join(lines) + "\n"


def timed_batch(program, backend, args, run: int, warmup: bool) -> Run:
    import sgl  # noqa: F401  (the language is reached through sgl)

    prefix = few_shot_prompt(run, args.shots)
    batch = [{"prefix": prefix, "question": f"What is {i} plus {i + 5}?"}
             for i in range(args.programs)]
    start = time.perf_counter()
    # the prefix is an argument here, so bind it: the tracer then sees it as constant text
    states = program.bind(prefix=prefix).run_batch(
        [{"question": b["question"]} for b in batch], backend=backend, warmup=warmup,
        num_threads=args.programs)
    seconds = time.perf_counter() - start
    metas = [s.get_meta_info("answer") for s in states]
    return Run(seconds, sum(m["prompt_tokens"] for m in metas),
               sum(m["cached_tokens"] for m in metas))


def main() -> None:
    import sgl
    from sgl_testing import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=32)
    parser.add_argument("--shots", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--update-docs", type=Path)
    args = parser.parse_args()

    @sgl.function
    def few_shot(s, prefix, question):
        s += prefix
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=args.max_tokens, stop="\n", temperature=0)

    results: dict[str, list[Run]] = {}
    run_number = 0
    for label, flags, modes in [("radix cache", [], [("warm-up", True), ("no warm-up", False)]),
                                ("cache disabled", ["--disable-radix-cache"],
                                 [("warm-up", True)])]:
        server = ServerProcess("--max-total-tokens", "65536", *flags)
        try:
            backend = sgl.RuntimeEndpoint(server.base_url)
            few_shot.run(prefix="Hello.\n", question="What is 1 plus 1?", backend=backend)
            for _ in range(args.reps):
                for mode, warmup in modes:
                    run_number += 1
                    run = timed_batch(few_shot, backend, args, run_number, warmup)
                    results.setdefault(f"{label}|{mode}", []).append(run)
                    print(f"{label}, {mode}: {run.seconds:.2f} s, {run.prompt_tokens} prompt "
                          f"tokens, {run.cached_tokens} cached", flush=True)
            backend.shutdown()
        finally:
            server.stop()
    table = report(args, results)
    print(table)
    if args.update_docs:
        text = args.update_docs.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        args.update_docs.write_text(text[:start] + "\n" + table + text[end:])


def report(args: argparse.Namespace, results: dict[str, list[Run]]) -> str:
    base = statistics.median(r.seconds for r in results["cache disabled|warm-up"])
    lines = [
        f"Command: `.venv/bin/python benchmarks/lang_run_batch.py --reps {args.reps}`",
        "",
        f"- {platform.processor() or platform.machine()}, {platform.python_version()}, "
        f"`sgl serve` defaults (float32) but `--max-total-tokens 65536`",
        f"- {args.programs} programs, a {args.shots * 2}-pair few-shot prompt, "
        f"{args.max_tokens} output tokens at most, median of {args.reps} runs",
        "",
        "| server | prefix warm-up | seconds | prompt tokens | cached tokens | vs cache disabled |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, runs in results.items():
        label, mode = key.split("|")
        seconds = statistics.median(r.seconds for r in runs)
        mid = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
        lines.append(f"| {label} | {mode} | {seconds:.2f} | {mid.prompt_tokens} | "
                     f"{mid.cached_tokens} | **{base / seconds:.2f}x** |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
