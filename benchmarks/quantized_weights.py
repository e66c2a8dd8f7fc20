"""The bundled SmolLM2 GGUF served quantized next to the same model dequantized: memory and decode.

    .venv/bin/python benchmarks/quantized_weights.py
    .venv/bin/python benchmarks/quantized_weights.py --configs gguf:float32,none:bfloat16 --batch-sizes 1

Each configuration (``quantization:dtype``; ``:int8x`` appended for ``--int8-activations on``,
``:exact`` for ``off``, nothing for the default ``auto``) is
one ``sgl.Engine``, started alone, so its scheduler process holds only that model. Reported per configuration:

* ``weights MiB``: ``weights_bytes`` of the scheduler's info (parameters, buffers and the CPU
  kernels' packed copies; what ``/get_server_info`` shows).
* ``RSS MiB``: the scheduler process's resident memory after a warm-up request (the KV pool
  is ``--max-total-tokens`` in every configuration).
* decode tokens/s at each batch size: ``batch`` requests of the same 32-token prompt
  (different seeds of nothing: greedy, EOS ignored), sent together; the time of
  ``--tokens`` new tokens minus the time of 1, so prefill is left out:
  ``batch * (tokens - 1) / (t_tokens - t_1)``. Median of ``--reps``.

Ratios are against the first configuration, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

PROMPT = ("The river town woke slowly. Fishermen pushed their boats into the grey water while "
          "the baker stacked warm loaves on the counter and argued with the miller.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs",
                   default="none:bfloat16,gguf:bfloat16,gguf:bfloat16:exact,gguf:float32,"
                           "gguf:float32:int8x,none:float32",
                   help="comma-separated quantization:dtype[:int8x|:exact]; the first is the "
                        "baseline (quantization: none or gguf; dtype: float32 or bfloat16; "
                        "int8x: --int8-activations on, exact: off; default: auto)")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernel-threads", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=8192,
                   help="the KV pool of every configuration (a fixed size, so that the "
                        "scheduler's RSS differs by the weights only; sized from free memory "
                        "the pool would grow into what quantized weights leave free)")
    args = p.parse_args(argv)
    try:
        args.configs = [tuple(c.split(":")) for c in args.configs.split(",")]
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error("--configs takes quantization:dtype pairs and --batch-sizes integers")
    for config in args.configs:
        if len(config) not in (2, 3) or config[0] not in ("none", "gguf") \
                or config[1] not in ("float32", "bfloat16") \
                or config[2:] not in ((), ("int8x",), ("exact",)):
            p.error(f"--configs: bad entry {':'.join(config)!r}; e.g. gguf:float32 or "
                    "gguf:float32:int8x")
    if min(args.batch_sizes) < 1 or args.tokens < 2:
        p.error("--batch-sizes must be positive and --tokens at least 2")
    return args


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def decode_rate(engine: Any, batch: int, tokens: int) -> float:
    def timed(n: int) -> float:
        params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        start = time.perf_counter()
        engine.generate([PROMPT] * batch, params)
        return time.perf_counter() - start

    return batch * (tokens - 1) / (timed(tokens) - timed(1))


def measure(quantization: str, dtype: str, args: argparse.Namespace,
            int8_activations: str = "auto") -> dict[str, Any]:
    import sgl

    settings: dict[str, Any] = {"quantization": quantization, "dtype": dtype,
                                "int8_activations": int8_activations,
                                "log_level": "warning", "disable_radix_cache": True,
                                "max_total_tokens": args.max_total_tokens}
    if args.kernel_threads:
        settings["kernel_threads"] = args.kernel_threads
    engine = sgl.Engine(**settings)
    try:
        engine.generate(PROMPT, {"max_new_tokens": 8})
        for batch in args.batch_sizes:  # record each batch size's decode graph
            engine.generate([PROMPT] * batch, {"max_new_tokens": 4, "ignore_eos": True})
        result = {"weights_mib": engine.info.weights_bytes / 2**20,
                  "rss_mib": rss_mib(engine._handle.processes[0].pid), "decode": {}}
        for batch in args.batch_sizes:
            rates = [decode_rate(engine, batch, args.tokens) for _ in range(args.reps)]
            result["decode"][batch] = statistics.median(rates)
        return result
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    from tqdm.auto import tqdm

    args = parse_args(argv)
    results = {}
    for config in tqdm(args.configs, desc="configurations", unit="engine"):
        mode = {(): "auto", ("int8x",): "on", ("exact",): "off"}[config[2:]]
        results[config] = measure(config[0], config[1], args, int8_activations=mode)
    base = results[args.configs[0]]
    head = ["configuration", "weights MiB", "x", "RSS MiB"]
    head += [f"decode b{b} tok/s" for b in args.batch_sizes] + [
        f"x b{b}" for b in args.batch_sizes]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for config, r in results.items():
        row = [":".join(config), f"{r['weights_mib']:.1f}",
               f"{r['weights_mib'] / base['weights_mib']:.2f}", f"{r['rss_mib']:.0f}"]
        row += [f"{r['decode'][b]:.1f}" for b in args.batch_sizes]
        row += [f"{r['decode'][b] / base['decode'][b]:.2f}x" for b in args.batch_sizes]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
