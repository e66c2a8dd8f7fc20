"""Objects and tensors the scheduler keeps, round after round of varied requests with aborts:
the in-process half of the soak (``benchmarks/soak.py`` measures the processes from outside).

    .venv/bin/python benchmarks/scheduler_census.py [--rounds 4] [--requests 120]

Runs the real scheduler and SmolLM2 in this process (the tests' harness, over its real ZMQ
sockets): rounds of requests with random prompts, lengths, logprobs and temperatures, a fifth
of them aborted at a random step; the cache is flushed after each round. Prints the resident
memory, the live tensors and every object type whose count grew by more than 50 since round 0.
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "core"))

from test_scheduler import QUESTIONS, Harness  # noqa: E402  (the tests' scheduler harness)

from sgl.engine.messages import LogprobOptions  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def census() -> tuple[collections.Counter[str], int, float]:
    """Live objects by type name, the number of live tensors and their MiB."""
    gc.collect()
    objects = gc.get_objects()
    tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    return (collections.Counter(type(o).__name__ for o in objects), len(tensors),
            sum(t.numel() * t.element_size() for t in tensors) / 2**20)


def one_round(h: Harness, rng: random.Random, prompts: list[list[int]], count: int) -> None:
    rids, abort = [], {}
    for _ in range(count):
        prompt = rng.choice(prompts) + [rng.randrange(100, 40000)
                                        for _ in range(rng.randrange(0, 60))]
        logprobs = LogprobOptions(return_logprob=rng.random() < 0.3,
                                  top_logprobs_num=rng.choice([0, 2]))
        rid = h.submit(prompt, logprobs=logprobs, max_new_tokens=rng.choice([1, 4, 16, 48]),
                       temperature=rng.choice([0, 0.8]))
        rids.append(rid)
        if rng.random() < 0.2:
            abort[rid] = rng.randrange(0, 20)
    h.run(rids, abort=abort)
    assert h.scheduler.flush_cache()["success"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=120)
    args = parser.parse_args()
    h = Harness(Path(tempfile.mkdtemp()), max_total_tokens=4096, disable_cpu_graph=True)
    rng = random.Random(0)
    try:
        prompts = [h.chat_ids(q) for q in QUESTIONS]
        base: collections.Counter[str] | None = None
        with torch.inference_mode():
            for number in range(args.rounds):
                one_round(h, rng, prompts, args.requests)
                counts, tensors, tensor_mib = census()
                base = base or counts
                grown = sorted(((k, counts[k] - base[k]) for k in counts
                                if counts[k] - base[k] > 50), key=lambda kv: -kv[1])
                print(f"round {number}: RSS {rss_mib():.0f} MiB, {tensors} tensors "
                      f"({tensor_mib:.1f} MiB), grown since round 0: {grown[:8] or 'nothing'}")
    finally:
        h.close()


if __name__ == "__main__":
    main()
