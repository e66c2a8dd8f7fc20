"""What an EAGLE head costs a decode step, next to the step itself, on the bundled SmolLM2.

    .venv/bin/python benchmarks/eagle_head.py [--dtype bfloat16] [--batch 1,4] [--reps 20]

No trained head exists for SmolLM2 here, so acceptance (and so the speed-up) cannot be
measured; what can be is the price of drafting. Random heads in the published layouts, as wide
as SmolLM2 (576): EAGLE (its drafts scored by the target's 49152-token LM head), EAGLE with
a 4096-token ``--speculative-token-map``, and EAGLE-3 with an 8192-token draft vocabulary. For
``--batch`` requests of a 300-token prompt each: the target's decode step (replayed where sgl
replays it), the head catching up on one kept position per request (``observe``), and drafting
``num_draft_tokens - 1`` = 3 tokens each (``propose``, a chain), median ms of ``--reps``;
threads as ``sgl serve`` sets them by default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    sys.path[:0] = [str(ROOT / "tests/plugins/speculative"), str(ROOT / "tests/core")]
    from test_eagle_speculation import tiny_llama_config, write_head  # the tests' head writer

    from sgl.config import load_settings
    from sgl.engine.batch_builder import BatchSeq, make_forward_batch
    from sgl.engine.model_runner import ModelRunner
    from sgl.engine.speculative import SpeculativeDecoding
    from sgl.forward_batch import ForwardMode
    from sgl.plugins import create_plugin_manager
    from sgl.speculative import DraftRequest, TargetStates

    tmp = Path(tempfile.mkdtemp())
    config = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                  max_position_embeddings=8192)
    write_head(tmp / "eagle", 1, tiny_llama_config(**config), target_hidden=576, seed=1,
               target_vocab=49152)
    write_head(tmp / "eagle3", 3, tiny_llama_config(**config), target_hidden=576, seed=2,
               target_vocab=49152, draft_vocab=8192)
    torch.save(torch.randperm(49152)[:4096], tmp / "hot.pt")
    heads = {"EAGLE": ("EAGLE", tmp / "eagle", {}),
             "EAGLE, 4096 hot tokens": ("EAGLE", tmp / "eagle",
                                        {"speculative_token_map": str(tmp / "hot.pt")}),
             "EAGLE-3, 8192 draft vocab": ("EAGLE3", tmp / "eagle3", {})}

    from sgl.kernels import cpu
    from sgl.threads import plan_threads

    plan = plan_threads(None, None, kernels=cpu.load() is not None)  # as sgl serve runs
    torch.set_num_threads(plan.torch_threads)
    if cpu.load() is not None:
        cpu.set_threads(plan.kernel_threads)
    pm = create_plugin_manager()
    batches = [int(b) for b in args.batch.split(",")]
    print(f"SmolLM2, {args.dtype}, torch threads {plan.torch_threads}, kernel threads "
          f"{plan.kernel_threads}")
    print("| head | batch | target decode step (ms) | observe (ms) | propose 3 (ms) | "
          "head / step |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, (algorithm, path, extra) in heads.items():
        settings = load_settings(env={}, cli={
            "dtype": args.dtype, "speculative_algorithm": algorithm,
            "speculative_draft_model_path": str(path), **extra})
        runner = ModelRunner(dtype=args.dtype, registries=pm.registries, plugin_manager=pm,
                             max_total_tokens=8192, max_running_requests=max(batches),
                             show_progress=False)
        spec = SpeculativeDecoding(settings, pm, runner)
        head = spec.algorithm
        for batch in batches:
            rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
            prompts = [torch.randint(100, 40000, (300,)).tolist() for _ in rows]
            with torch.inference_mode():
                hidden = runner.forward(make_forward_batch(runner, ForwardMode.EXTEND, [
                    BatchSeq(r, 0, p) for r, p in zip(rows, prompts)]))
                source = hidden if spec.target_hidden == "final" else runner.model.captured_hidden
                tokens = [p + [7] for p in prompts]
                head.observe([TargetStates(f"r{i}", r, 0, source[300 * i:300 * (i + 1)],
                                           t[1:]) for i, (r, t) in enumerate(zip(rows, tokens))])
                asks = [DraftRequest(f"r{i}", t, 3) for i, t in enumerate(tokens)]
                step = make_forward_batch(runner, ForwardMode.DECODE, [
                    BatchSeq(r, 300, [7]) for r in rows])
                decode = timed(lambda: runner.forward(step), args.reps)
                one = [TargetStates(f"r{i}", r, 299, source[300 * i + 299:300 * (i + 1)], t[300:])
                       for i, (r, t) in enumerate(zip(rows, tokens))]
                observe = timed(lambda: head.observe(one), args.reps)
                propose = timed(lambda: head.propose(asks), args.reps)
            print(f"| {label} | {batch} | {decode:.1f} | {observe:.1f} | {propose:.1f} | "
                  f"{(observe + propose) / decode:.2f} |", flush=True)
            for i, r in enumerate(rows):
                head.release(f"r{i}")
                runner.kv_pool.free(runner.req_to_token_pool.req_to_token[r, :301].clone())
                runner.req_to_token_pool.free(r)


if __name__ == "__main__":
    main()
