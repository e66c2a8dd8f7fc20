"""The radix prefix cache on and off, in one run: a shared-prefix workload and a no-hit one.

    .venv/bin/python benchmarks/prefix_cache.py [--dtype bfloat16] [--update-docs docs/benchmarks.md]

* **shared prefix**, in the style of SGLang's generated-shared-prefix dataset: ``--groups``
  groups of ``--prompts-per-group`` prompts; the prompts of a group share a
  ``--system-len``-token system prompt and each adds a ``--question-len``-token question;
  ``--output-len`` greedy tokens each (EOS ignored). Every prompt is sent at once, in a
  shuffled order, to ``sgl.Engine`` with the cache (``radix``, schedule policy ``lpm``) and
  with ``disable_radix_cache=True``. Each run gets a fresh engine.
* **no hits**: the same shapes with every prompt distinct (random token ids), so the cache
  finds nothing: what it costs when it cannot help. Runs are interleaved (off, on, off, on, ...)
  and the median of ``--reps`` is reported, because the machine is shared and noisy.

Throughput counts input and output tokens over the wall time of the whole batch; TTFT is the
mean of each request's time to first token (queueing included, as all arrive at once).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- prefix_cache:begin -->", "<!-- prefix_cache:end -->"


@dataclass
class Run:
    seconds: float
    tokens: int
    mean_ttft: float
    cached_tokens: int
    cache_seconds: float

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def shared_prefix_workload(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    prompts = []
    for _ in range(args.groups):
        system = [rng.randrange(100, 40000) for _ in range(args.system_len)]
        for _ in range(args.prompts_per_group):
            prompts.append(system + [rng.randrange(100, 40000) for _ in range(args.question_len)])
    rng.shuffle(prompts)
    return prompts


def no_hit_workload(args: argparse.Namespace, rng: random.Random, count: int) -> list[list[int]]:
    length = args.system_len + args.question_len
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def run(engine: Any, prompts: list[list[int]], output_len: int) -> Run:
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    assert engine.flush_cache()["success"]
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = sum(len(p) for p in prompts) + sum(r["meta_info"]["completion_tokens"]
                                                 for r in results)
    ttft = statistics.mean(r["meta_info"]["time_to_first_token"] for r in results)
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    cache_seconds = engine.get_server_info()["internal_states"][0].get("cache_seconds", 0.0)
    return Run(seconds, tokens, ttft, cached, cache_seconds)


def main() -> None:
    import sgl

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--no-hit-prompts", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--update-docs", metavar="PATH")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    shared = shared_prefix_workload(args, rng)
    common = {"dtype": args.dtype, "num_threads": args.threads, "log_level": "warning",
              "max_total_tokens": 40_000}
    timed_plugin = str(Path(__file__).with_name("timed_radix_plugin.py"))
    configs = {"off": {"disable_radix_cache": True},
               "on": {"load_plugins": (timed_plugin,), "cache_policy": "radix-timed"}}
    results: dict[str, dict[str, list[Run]]] = {"shared": {"off": [], "on": []},
                                                  "nohit": {"off": [], "on": []}}

    def measure(workload: str, name: str, prompts: list[list[int]]) -> None:
        # a fresh engine (scheduler process) per run, so that neither setting keeps the
        # memory layout of one process throughout
        with sgl.Engine(**common, **configs[name]) as engine:
            engine.generate(input_ids=[list(range(100, 164))], sampling_params={"max_new_tokens": 4})
            results[workload][name].append(run(engine, prompts, args.output_len))
        print(f"{workload}, cache {name}: {results[workload][name][-1].seconds:.1f} s", flush=True)

    for rep in range(args.reps):
        nohit = no_hit_workload(args, random.Random(args.seed + 1 + rep), args.no_hit_prompts)
        for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            measure("nohit", name, nohit)
    for name in ("off", "on"):
        measure("shared", name, shared)

    table = report(args, results)
    print(table)
    if args.update_docs:
        with open(args.update_docs) as f:
            text = f.read()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        with open(args.update_docs, "w") as f:
            f.write(text[:start] + "\n" + table + text[end:])


def report(args: argparse.Namespace, results: dict[str, dict[str, list[Run]]]) -> str:
    def median(runs: list[Run], key: str) -> float:
        return statistics.median(getattr(r, key) for r in runs)

    lines = [
        f"Command: `.venv/bin/python benchmarks/prefix_cache.py --dtype {args.dtype}`",
        "",
        f"- {platform.processor() or platform.machine()}, {args.threads} thread(s), {args.dtype}",
        f"- shared prefix: {args.groups} groups x {args.prompts_per_group} prompts, "
        f"{args.system_len}-token system prompt + {args.question_len}-token question, "
        f"{args.output_len} output tokens, all sent at once",
        f"- no hits: {args.no_hit_prompts} distinct prompts of "
        f"{args.system_len + args.question_len} tokens, {args.output_len} output tokens; "
        f"median of {args.reps} interleaved runs",
        "",
        "| workload | cache | seconds | tokens/s | mean TTFT (s) | cached tokens | time in the cache | vs cache off |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, label in (("shared", "shared prefix"), ("nohit", "no hits")):
        base = median(results[workload]["off"], "throughput")
        for name in ("off", "on"):
            runs = results[workload][name]
            tput = median(runs, "throughput")
            lines.append(
                f"| {label} | {name} | {median(runs, 'seconds'):.1f} | {tput:.0f} | "
                f"{median(runs, 'mean_ttft'):.2f} | {int(median(runs, 'cached_tokens'))} | "
                f"{_share(runs)} | **{tput / base:.2f}x** |")
    return "\n".join(lines) + "\n"


def _share(runs: list[Run]) -> str:
    """The scheduler's time inside the cache policy, as a share of the wall time."""
    if not any(r.cache_seconds for r in runs):
        return "-"
    share = statistics.median(r.cache_seconds / r.seconds for r in runs)
    return f"{100 * share:.2f}%"


if __name__ == "__main__":
    main()
