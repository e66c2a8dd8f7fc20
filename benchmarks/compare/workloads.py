"""The workloads of the comparison, and the measurement of one cell (engine x workload x
concurrency).

Every engine gets the same text prompts, built by sgl bench's dataset generators from random
token ids of the model's vocabulary and sent through the OpenAI completions route with
``temperature 0`` and ``ignore_eos``, so every request generates exactly its output length.
Each cell has its own seed: no cell's prompts are in a prefix cache from an earlier cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_bench.datasets import BenchRequest, generated_shared_prefix, random_requests


@dataclass(frozen=True)
class Workload:
    """:param name: key in the results. :param label: how the docs name it."""

    name: str
    label: str
    input_len: int
    output_len: int
    system_prompt_len: int = 0

    def num_prompts(self, concurrency: int) -> int:
        """Two waves at the concurrency, at least 8 requests."""
        return max(8, 2 * concurrency)

    def requests(self, tokenizer: Any, concurrency: int, seed: int) -> list[BenchRequest]:
        n = self.num_prompts(concurrency)
        cell_seed = seed * 1000 + concurrency + (500 if self.system_prompt_len else 0)
        if not self.system_prompt_len:
            return random_requests(tokenizer, num_prompts=n, input_len=self.input_len,
                                   output_len=self.output_len, seed=cell_seed, as_text=True)
        groups = max(1, n // 16)
        return generated_shared_prefix(
            tokenizer, num_groups=groups, prompts_per_group=n // groups,
            system_prompt_len=self.system_prompt_len, question_len=self.input_len,
            output_len=self.output_len, seed=cell_seed, as_text=True)

    def describe(self) -> str:
        if not self.system_prompt_len:
            return (f"{self.input_len} random tokens in, {self.output_len} out; "
                    f"max(8, 2 x concurrency) requests")
        return (f"groups of 16 requests share a {self.system_prompt_len}-token system prompt, "
                f"then {self.input_len} own tokens; {self.output_len} out; "
                f"max(8, 2 x concurrency) requests")


def default_workloads(input_len: int = 128, output_len: int = 128,
                      system_prompt_len: int = 512, question_len: int = 64) -> list[Workload]:
    return [Workload("random", "random", input_len, output_len),
            Workload("shared-prefix", "shared prefix", question_len, output_len,
                     system_prompt_len)]


def warmup_requests(tokenizer: Any, n: int = 2) -> list[BenchRequest]:
    """Short requests that share no prefix with any cell's prompts (their own seed)."""
    return random_requests(tokenizer, num_prompts=n, input_len=32, output_len=16, seed=987_654,
                           as_text=True)


def measure_server(base_url: str, requests: list[BenchRequest], concurrency: int,
                   model: str) -> dict[str, Any]:
    """Send ``requests`` at ``concurrency`` through the OpenAI completions route and return
    sgl bench's metrics of the run."""
    from sgl_bench.metrics import compute_metrics
    from sgl_bench.serving import ServingRun, run_serving

    run = ServingRun(base_url=base_url, backend="openai-completions", model=model,
                     timeout=600.0)
    results, duration = run_serving(run, requests, max_concurrency=concurrency)
    metrics = compute_metrics(results, duration)
    errors = [r.error for r in results if not r.success]
    metrics["first_error"] = errors[0] if errors else None
    return metrics
