"""Tensor parallelism on this machine: N ranks against one process, and where a rank's decode
step goes (a torch.profiler profile of the leader: the all-reduces, the all-gather of the
logits and the broadcast of each call).

    .venv/bin/python benchmarks/tensor_parallel.py [--tp 2] [--dtype bfloat16]
        [--batch-sizes 1,16] [--steps 30] [--model smollm2-8-heads|bundled]

``smollm2-8-heads`` (default) is a random-weight Llama of SmolLM2-135M's size (576 wide, 30
layers, 1536 MLP, 49152 vocabulary) with 8 heads and 2 key/value heads, so that 2 and 4 ranks
divide it; ``bundled`` is SmolLM2 itself (9 heads: ``--tp 3``). Part 1 runs ``sgl.Engine`` at
``--tp-size 1`` and ``N`` with the defaults otherwise (threads, cores): a 512-token prefill,
and greedy decoding of ``B`` requests (``ignore_eos``, 64 tokens). Part 2 spawns the ranks
itself with the tp strategy's own code, decodes ``--steps`` steps of ``B`` requests on the
leader, first plainly, then under torch.profiler, and reports per step: the wall time, and
from the profile the time inside the collectives (the shared-memory all-reduce and all-gather
of ranks on one machine, gloo's broadcast of each call).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

PROMPT_LEN = 64
OUTPUT_LEN = 64


def write_model(kind: str) -> str | None:
    if kind == "bundled":
        return None
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgl.model_loader import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    path = Path(tempfile.mkdtemp()) / "smollm2-8-heads"
    LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)
    return str(path)


def engine_rates(model: str | None, tp: int, dtype: str, batches: list[int]) -> dict[str, float]:
    import sgl

    engine = sgl.Engine(model, dtype=dtype, tp_size=tp, max_total_tokens=16384,
                        context_length=2048, log_level="warning")
    try:
        g = torch.Generator().manual_seed(1)
        rates: dict[str, float] = {}
        prompt = torch.randint(100, 40000, (512,), generator=g).tolist()
        engine.generate(input_ids=prompt[:32], sampling_params={"max_new_tokens": 2})  # warm
        times = []
        for i in range(3):
            start = time.perf_counter()
            engine.generate(input_ids=[i, *prompt[1:]], sampling_params={"max_new_tokens": 1})
            times.append(time.perf_counter() - start)
        rates["prefill 512 tok/s"] = 512 / statistics.median(times)
        for b in batches:
            prompts = [torch.randint(100, 40000, (PROMPT_LEN,), generator=g).tolist()
                       for _ in range(b)]
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params={
                "max_new_tokens": OUTPUT_LEN, "ignore_eos": True, "temperature": 0})
            elapsed = time.perf_counter() - start
            rates[f"decode b{b} tok/s"] = sum(len(o["output_ids"]) for o in outs) / elapsed
        return rates
    finally:
        engine.shutdown()


def profile_rank(rank: int, tp: int, addr: str, model: str | None, dtype: str, batch: int,
                 steps: int, results: Any) -> None:
    from sgl.config import ServerSettings
    from sgl.engine.batch_builder import BatchSeq, make_forward_batch
    from sgl.engine.setup import build_runner, prepare_process
    from sgl.forward_batch import ForwardMode
    from sgl.parallel import RankInfo
    from sgl.plugins import create_plugin_manager
    from sgl_parallel_tp.strategy import TensorParallel

    settings = ServerSettings(model_path=model, dtype=dtype, tp_size=tp,
                              max_total_tokens=8192, context_length=2048)
    strategy = TensorParallel(settings)
    strategy.init_process(RankInfo("tp", rank, tp, rank, tp, addr))
    pm = create_plugin_manager()
    prepare_process(settings, pm)
    runner = build_runner(settings, pm)
    if rank:
        strategy.follow(runner)
        return
    strategy.lead(runner)
    g = torch.Generator().manual_seed(2)
    rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
    seqs = [BatchSeq(row, 0, torch.randint(100, 40000, (PROMPT_LEN,), generator=g).tolist())
            for row in rows]
    hidden = runner.forward(make_forward_batch(runner, ForwardMode.EXTEND, seqs))
    last = torch.arange(batch) * PROMPT_LEN + PROMPT_LEN - 1
    ids = runner.logits_at(hidden, last).argmax(-1).tolist()

    def step(position: int) -> list[int]:
        batch_seqs = [BatchSeq(row, position, [tok]) for row, tok in zip(rows, ids)]
        out = runner.forward(make_forward_batch(runner, ForwardMode.DECODE, batch_seqs))
        return runner.logits_at(out, torch.arange(batch)).argmax(-1).tolist()

    for i in range(3):  # warm up
        ids = step(PROMPT_LEN + i)
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    for i in range(steps):
        ids = step(PROMPT_LEN + 3 + i)
    plain = (time.perf_counter() - start) / steps * 1000
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            ids = step(PROMPT_LEN + 3 + steps + i)
    wall = (time.perf_counter() - start) / steps * 1000
    collectives: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.lower()
        if name.startswith(("gloo:", "sgl_tp::")):
            collectives[event.key] = event.cpu_time_total / 1000 / steps
    runner.mirror.close()
    results.put({"batch": batch, "step ms": plain, "step ms (profiled)": wall,
                 "collectives": collectives})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default="smollm2-8-heads", choices=["smollm2-8-heads", "bundled"])
    ap.add_argument("--no-engine", action="store_true", help="only the profile (part 2)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model = write_model(args.model)

    if not args.no_engine:
        one = engine_rates(model, 1, args.dtype, batches)
        many = engine_rates(model, args.tp, args.dtype, batches)
        print(f"\n{args.model}, {args.dtype}: sgl.Engine --tp-size 1 against {args.tp}")
        print(f"| measurement | tp 1 | tp {args.tp} | tp {args.tp} / tp 1 |")
        print("|---|---:|---:|---:|")
        for key in one:
            print(f"| {key} | {one[key]:.1f} | {many[key]:.1f} | {many[key] / one[key]:.2f}x |")

    from sgl_testing import free_port

    ctx = mp.get_context("spawn")
    print(f"\nwhere the leader's decode step goes ({args.tp} ranks, {args.steps} steps, "
          "torch.profiler; ms per step)")
    for batch in batches:
        results = ctx.Queue()
        addr = f"127.0.0.1:{free_port()}"
        procs = [ctx.Process(target=profile_rank, args=(r, args.tp, addr, model, args.dtype,
                                                         batch, args.steps, results))
                 for r in range(args.tp)]
        for p in procs:
            p.start()
        result = results.get(timeout=900)
        for p in procs:
            p.join(timeout=60)
        total = sum(result["collectives"].values())
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(result["collectives"].items()))
        print(f"batch {batch}: step {result['step ms']:.2f} ms ({result['step ms (profiled)']:.2f}"
              f" ms profiled), in collectives {total:.2f} ms "
              f"({total / result['step ms (profiled)']:.0%} of the profiled step): {parts}")


if __name__ == "__main__":
    main()
