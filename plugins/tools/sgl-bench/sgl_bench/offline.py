"""``sgl bench offline``: every request at once into an in-process ``sgl.Engine``.

The engine's continuous batching decides the rest, as in ``benchmarks/offline_throughput.py``.
Timings per request come from the engine's own ``meta_info`` (``time_to_first_token``,
``e2e_latency``, measured in the server half from receipt); the duration is wall time around the
whole batch.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from sgl_bench.datasets import BenchRequest
from sgl_bench.metrics import summarize

__all__ = ["run_offline"]


async def _generate_all(engine: Any, requests: list[BenchRequest], ignore_eos: bool,
                        on_done: Callable[[], None]) -> list[dict[str, Any]]:
    async def one(req: BenchRequest) -> dict[str, Any]:
        params = {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": ignore_eos}
        if isinstance(req.prompt, str):
            out = await engine.async_generate(req.text, params)
        else:
            out = await engine.async_generate(input_ids=req.prompt, sampling_params=params)
        on_done()
        return out

    return list(await asyncio.gather(*(one(r) for r in requests)))


def run_offline(engine: Any, requests: list[BenchRequest], *, ignore_eos: bool = True,
                on_done: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run ``requests`` through ``engine`` at once; returns the ``metrics`` object."""
    start = time.perf_counter()
    outs = asyncio.run(_generate_all(engine, requests, ignore_eos, on_done))
    duration = time.perf_counter() - start
    metas = [o["meta_info"] for o in outs]
    total_in = sum(m["prompt_tokens"] for m in metas)
    total_out = sum(m["completion_tokens"] for m in metas)
    ttfts = [m["time_to_first_token"] for m in metas if m.get("time_to_first_token") is not None]
    return {
        "completed": len(outs),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "cached_tokens": sum(m.get("cached_tokens", 0) for m in metas),
        "request_throughput": len(outs) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "ttft_ms": summarize(ttfts),
        "e2e_latency_ms": summarize([m["e2e_latency"] for m in metas if "e2e_latency" in m]),
        "mean_output_len": statistics.fmean(m["completion_tokens"] for m in metas),
    }
