"""``sgl bench one-batch``: the latency of one static batch, on sgl's ``ModelRunner`` directly.

Like SGLang's ``bench_one_batch``: no scheduler, no HTTP. ``batch_size`` prompts of
``input_len`` random token ids are prefilled in one forward pass, then ``output_len - 1`` decode
steps follow, each one forward pass of the whole batch plus the greedy pick (what the
scheduler's greedy sampler does). Each step is timed on its own.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["load_runner", "run_one_batch"]


def load_runner(*, model_path: str | None, dtype: str, quantization: str = "auto",
                int8_activations: str = "auto", attention_backend: str,
                num_threads: int | None, page_size: int, context_length: int | None,
                max_batch: int, max_tokens: int, load_plugins: tuple[str, ...] = (),
                disable_plugins: tuple[str, ...] = ()) -> Any:
    """A ``ModelRunner`` sized for the largest case, with torch's and the kernels' thread
    counts set as the scheduler sets them."""
    from sgl.engine.model_runner import ModelRunner
    from sgl.engine.setup import configure_threads
    from sgl.plugins import PluginSelection, create_plugin_manager

    configure_threads(num_threads, None)
    pm = create_plugin_manager(PluginSelection.from_args(list(load_plugins),
                                                         list(disable_plugins)))
    return ModelRunner(model_path=model_path, dtype=dtype, quantization=quantization,
                       int8_activations=int8_activations, attention_backend=attention_backend,
                       registries=pm.registries, plugin_manager=pm, max_total_tokens=max_tokens,
                       max_running_requests=max_batch, context_length=context_length,
                       page_size=page_size, show_progress=False)


def _argmax() -> Callable[[Any], Any]:
    try:
        from sgl.kernels.cpu import argmax_rows  # the scheduler's greedy pick on CPU

        return argmax_rows
    except ImportError:
        return lambda logits: logits.max(dim=-1).indices


def run_one_batch(runner: Any, *, batch_size: int, input_len: int, output_len: int,
                  seed: int = 0, on_step: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Prefill one batch, decode ``output_len - 1`` steps; returns the case's results."""
    import torch

    from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
    from sgl.forward_batch import ForwardMode

    if min(batch_size, input_len, output_len) < 1:
        raise ValueError("batch size, input length and output length must be at least 1")
    rng = random.Random(seed)
    vocab = int(runner.vocab_size)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(input_len)]
               for _ in range(batch_size)]
    argmax = _argmax()
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    lengths = [input_len] * batch_size
    steps: list[float] = []
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            batch = make_forward_batch(runner, ForwardMode.EXTEND,
                                       [BatchSeq(r, 0, p) for r, p in zip(rows, prompts)])
            ids = argmax(runner.forward_logits(batch)).tolist()
            prefill = time.perf_counter() - start
            on_step()
            for _ in range(output_len - 1):
                t0 = time.perf_counter()
                batch = make_forward_batch(runner, ForwardMode.DECODE,
                                           [BatchSeq(r, n, [t])
                                            for r, n, t in zip(rows, lengths, ids)])
                ids = argmax(runner.forward_logits(batch)).tolist()
                steps.append(time.perf_counter() - t0)
                lengths = [n + 1 for n in lengths]
                on_step()
    finally:
        for row, n in zip(rows, lengths):
            release_sequence(runner, row, n)
    median = statistics.median(steps) if steps else None
    total = prefill + sum(steps)
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_latency_s": prefill,
        "prefill_throughput": batch_size * input_len / prefill,
        "median_decode_latency_s": median,
        "median_decode_throughput": batch_size / median if median else None,
        "decode_latencies_s": steps,
        "total_latency_s": total,
        "overall_throughput": batch_size * (input_len + output_len) / total,
    }
