"""transformers' ``generate`` in static batches: the baseline without a server.

At concurrency ``c`` the requests run in batches of ``c`` (left-padded), one batch after the
other, as a closed loop of ``c`` clients would see a server that batches statically. Each request
"arrives" when its batch starts; a logits processor stamps the time of every generation step, so
TTFT (the batch's prefill), inter-token latency and throughput come out of the same arithmetic as
for the servers (sgl bench's ``compute_metrics``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sgl_bench.datasets import BenchRequest


class TransformersStatic:
    label = "transformers generate (static batches)"

    def __init__(self, model_path: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.threads = threads
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path),
                                                          dtype=torch.bfloat16).eval()
        self.settings = (f"bf16, {threads} torch threads, greedy, batches of the concurrency; "
                         "timed in-process, so its TTFT has no HTTP, tokenizing or streaming "
                         "in it")

    def _batch(self, batch: list[BenchRequest]) -> list[Any]:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        from sgl_bench.metrics import RequestResult

        stamps: list[float] = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                stamps.append(time.perf_counter())
                return scores

        enc = self.tokenizer([r.text for r in batch], return_tensors="pt", padding=True,
                             add_special_tokens=False)
        new_tokens = max(r.output_len for r in batch)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, logits_processor=LogitsProcessorList([Stamp()]),
                                pad_token_id=self.tokenizer.pad_token_id)
        end = time.perf_counter()
        lengths = enc["attention_mask"].sum(dim=1).tolist()
        return [RequestResult(success=True, start=start, end=end, prompt_len=int(n),
                              output_len=r.output_len, chunk_times=stamps[:r.output_len])
                for r, n in zip(batch, lengths)]

    def measure(self, requests: list[BenchRequest], concurrency: int) -> dict[str, Any]:
        from sgl_bench.metrics import compute_metrics

        results = []
        start = time.perf_counter()
        for i in range(0, len(requests), concurrency):
            results += self._batch(requests[i:i + concurrency])
        metrics = compute_metrics(results, time.perf_counter() - start)
        metrics["first_error"] = None
        return metrics
