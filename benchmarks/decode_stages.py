"""sgl's decode step with its CPU optimisations switched on one after another, in one process.

    .venv/bin/python benchmarks/decode_stages.py [--batch-sizes 1,32] [--dtypes bfloat16,float32]

The stages (the "Decode stages" table of ``docs/benchmarks.md``), measured on the same loaded
model, interleaved, median of ``--reps``, one torch thread, ``--context`` prompt tokens:

* ``torch only``: no prepared weights (``F.linear``), sgl's C kernels off;
* ``+ oneDNN packed``: bfloat16 weights reordered once for oneDNN;
* ``+ C kernels``: the AMX matmul, decode attention, norm, SiLU, rotary and argmax kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.forward_batch import ForwardMode
from sgl.engine.model_runner import ModelRunner
from sgl.kernels import cpu
from sgl.layers.packed_linear import OneDnnWeight
from sgl.plugins import create_plugin_manager


class Decoder:
    """``batch`` random prompts prefilled once; each run decodes ``steps`` tokens after them."""

    def __init__(self, runner: ModelRunner, batch: int, context: int) -> None:
        self.runner, self.context = runner, context
        gen = torch.Generator().manual_seed(0)
        self.rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
        prompts = [torch.randint(1000, 40000, (context,), generator=gen).tolist()
                   for _ in range(batch)]
        fb = make_forward_batch(runner, ForwardMode.EXTEND,
                                [BatchSeq(r, 0, p) for r, p in zip(self.rows, prompts)])
        self.first = cpu.argmax_rows(runner.forward_logits(fb)).tolist()

    def run(self, steps: int) -> float:
        """Seconds per decode step, then the decoded KV is given back."""
        ids, lens = self.first, [self.context] * len(self.rows)
        start = time.perf_counter()
        for _ in range(steps):
            fb = make_forward_batch(self.runner, ForwardMode.DECODE,
                                    [BatchSeq(r, n, [t]) for r, n, t in zip(self.rows, lens, ids)])
            ids = cpu.argmax_rows(self.runner.forward_logits(fb)).tolist()
            lens = [n + 1 for n in lens]
        elapsed = (time.perf_counter() - start) / steps
        table = self.runner.req_to_token_pool.req_to_token
        for row, n in zip(self.rows, lens):
            self.runner.kv_pool.free(table[row, self.context:n].clone())
        return elapsed


def stages(runner: ModelRunner) -> dict[str, Any]:
    kernels = cpu.load()
    layers = [m for m in runner.model.modules() if hasattr(m, "packed")]
    prepared = {id(m): m.packed for m in layers}
    onednn = {id(m): OneDnnWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(
        m.weight, None), m.weight.shape[0], m.weight.dtype)
        if m.weight.dtype == torch.bfloat16 else None for m in layers}

    def stage(use_kernels: bool, packs: dict[int, Any] | None) -> Any:
        def switch() -> None:
            cpu._state.loaded = kernels if use_kernels else None  # what cpu.load() hands out
            for m in layers:
                m.packed = packs[id(m)] if packs else None
        return switch

    return {"torch only": stage(False, None), "+ oneDNN packed": stage(False, onednn),
            "+ C kernels": stage(True, prepared)}


def make_runner(pm: Any, dtype: str, batch: int, cpu_graphs: bool = True) -> ModelRunner:
    """The bundled model dequantized to ``dtype`` with room for ``batch`` sequences of a few
    hundred tokens."""
    return ModelRunner(model_path=None, dtype=dtype, registries=pm.registries,
                       plugin_manager=pm, max_total_tokens=batch * 400,
                       max_running_requests=batch, context_length=2048, show_progress=False,
                       cpu_graphs=cpu_graphs, quantization="none")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    pm = create_plugin_manager()
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            runner = make_runner(pm, dtype, batch)
            decoder = Decoder(runner, batch, args.context)
            switches = stages(runner)
            times: dict[str, list[float]] = {name: [] for name in switches}
            for _ in range(args.reps):
                for name, switch in switches.items():
                    switch()
                    decoder.run(1)  # warm-up of this configuration
                    times[name].append(decoder.run(args.steps))
            switches["+ C kernels"]()
            base = None
            for name, values in times.items():
                step = statistics.median(values)
                base = base or step
                print(f"{dtype:9s} batch {batch:3d}  {name:16s} {step * 1e3:7.1f} ms/step "
                      f"{batch / step:8.1f} tok/s  x{base / step:.2f}", flush=True)
            for row in decoder.rows:
                release_sequence(runner, row, args.context)


if __name__ == "__main__":
    main()
