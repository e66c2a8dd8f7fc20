"""A recorded decode step replayed whole on the kernel threads against the same step replayed
in parts, one kernel thread each (``sgl_kernels_cpu.graphs``), in one process.

    .venv/bin/python benchmarks/decode_parts.py [--batch-sizes 16,32] [--context 192]

For each batch size the bundled SmolLM2-135M-Instruct (in ``--dtype``) prefills ``batch``
random prompts of ``--context`` tokens, then records the decode forward twice: whole (both
threads share every kernel call) and in parts (one thread runs each part's calls alone). The two
replays alternate ``--reps`` times over the same inputs and KV; the table gives the median and
the fastest of each, and the hidden states of the two are checked to be the same bits. Only
the forward is timed (the LM head and the sampling after it are the same either way).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from decode_stages import Decoder
from sgl_kernels_cpu import graphs as cpu_graph
from sgl.engine.model_runner import ModelRunner
from sgl.kernels import cpu
from sgl.plugins import create_plugin_manager


def recorded(runner: ModelRunner, decoder: Decoder, parts: int) -> Any:
    """The graph of the decoder's batch, recorded in ``parts`` parts (1 or 2)."""
    split = cpu_graph.SPLIT_THREADS
    cpu_graph.SPLIT_THREADS = split if parts > 1 else 0
    try:
        runner.decode_graphs.clear()
        decoder.run(cpu_graph.SEEN_BEFORE_RECORDING + 1)  # seen, then recorded
    finally:
        cpu_graph.SPLIT_THREADS = split
    graph = next(g for g in runner.decode_graphs.graphs.values() if g is not None)
    if len(graph.parts) != parts:
        raise SystemExit(f"recorded {len(graph.parts)} part(s), wanted {parts}")
    return graph


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", default="16,32")
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="idle time before each replay, as a server's sampling and scheduling "
                        "leave between steps (the kernels' helper threads sleep after 0.2 ms)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if cpu.set_threads(cpu_graph.SPLIT_THREADS) != cpu_graph.SPLIT_THREADS:
        raise SystemExit(f"needs sgl's CPU kernels on {cpu_graph.SPLIT_THREADS} threads")
    pm = create_plugin_manager()
    print(f"| batch | whole, median (min) ms | {cpu_graph.SPLIT_THREADS} parts, median (min) ms "
          "| parts / whole |")
    print("|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runner = ModelRunner(model_path=None, dtype=args.dtype, registries=pm.registries,
                             plugin_manager=pm, max_total_tokens=batch * (args.context + 64),
                             max_running_requests=batch, context_length=args.context + 64,
                             show_progress=False, quantization="none")
        decoder = Decoder(runner, batch, args.context)
        graph_parts = recorded(runner, decoder, cpu_graph.SPLIT_THREADS)
        graph_whole = recorded(runner, decoder, 1)
        library = cpu.load()
        tapes = [part.tape for part in graph_parts.parts]
        for part in graph_parts.parts:  # the same inputs as the whole graph's
            for mine, whole in zip(part.inputs, graph_whole.parts[0].inputs):
                mine.copy_(whole[part.start:part.end])
        times: dict[str, list[float]] = {"whole": [], "parts": []}
        for _ in range(args.reps):
            time.sleep(args.gap_ms / 1e3)
            start = time.perf_counter()
            graph_whole.parts[0].tape.replay()
            times["whole"].append(time.perf_counter() - start)
            time.sleep(args.gap_ms / 1e3)
            start = time.perf_counter()
            library.replay_parts(tapes)
            times["parts"].append(time.perf_counter() - start)
        joined = torch.cat([part.output for part in graph_parts.parts])
        if not torch.equal(joined, graph_whole.output):
            raise SystemExit(f"batch {batch}: the parts' hidden states differ from the whole's")
        whole, parts = (statistics.median(times[k]) * 1e3 for k in ("whole", "parts"))
        print(f"| {batch} | {whole:.2f} ({min(times['whole']) * 1e3:.2f}) | {parts:.2f} "
              f"({min(times['parts']) * 1e3:.2f}) | {parts / whole:.3f} |")
        del runner, decoder, graph_parts, graph_whole


if __name__ == "__main__":
    main()
