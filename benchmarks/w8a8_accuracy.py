"""How far sgl's int8 modes move a model from its bfloat16 self: ``--quantization w8a8_int8``
(int8 weights per channel and int8 activations per token) and, for comparison, ``int8``
(weight-only 8-bit blocks), each against the same Hugging Face folder served dense in bfloat16.

For each prompt the dense model's greedy continuation is taken as the reference text; each mode
then runs prompt and continuation in one prefill (teacher forcing) and its logits are compared
position by position with the dense model's: the largest and mean absolute difference, that
difference relative to the logits' spread, and how often the top token agrees. Then each mode
generates greedily on its own, and the report gives the share of continuations identical to the
dense model's and the mean number of tokens before the first difference.

    .venv/bin/python benchmarks/w8a8_accuracy.py --model ~/.cache/sgl/bench-peers/models/smollm2-hf
    .venv/bin/python benchmarks/w8a8_accuracy.py --model /path/to/ladder/hf --new-tokens 32

The model is any Hugging Face folder sgl serves (``benchmarks/compare --setup-only`` writes the
ladder's random-weight folders); on random weights the numbers measure the arithmetic, not the
language.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):",
    "List three uses of a paperclip:",
    "Translate to French: The weather is nice today.",
    "Once upon a time, in a village by the mountains,",
    "What is 17 times 23? Think step by step.",
]


def _runner(path: Path, quantization: str):
    from sgl.engine.model_runner import ModelRunner
    from sgl.kernels import cpu
    from sgl.plugins import create_plugin_manager

    torch.set_num_threads(1)
    cpu.set_threads(max(1, len(os.sched_getaffinity(0))))
    pm = create_plugin_manager()
    return ModelRunner(model_path=str(path), quantization=quantization, dtype="bfloat16",
                       registries=pm.registries, plugin_manager=pm, max_total_tokens=4096,
                       max_running_requests=2, show_progress=False)


def _logits(runner, ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of ``ids``, in one prefill."""
    from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
    from sgl.forward_batch import ForwardMode

    row = runner.req_to_token_pool.alloc()
    batch = make_forward_batch(runner, ForwardMode.EXTEND, [BatchSeq(row, 0, ids)])
    out = runner.logits_at(runner.forward(batch), torch.arange(len(ids)))
    release_sequence(runner, row, len(ids))
    return out


def _greedy(runner, prompt: list[int], new: int) -> list[int]:
    from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
    from sgl.forward_batch import ForwardMode

    row = runner.req_to_token_pool.alloc()
    batch = make_forward_batch(runner, ForwardMode.EXTEND, [BatchSeq(row, 0, prompt)])
    logits = runner.logits_at(runner.forward(batch), torch.tensor([len(prompt) - 1]))
    out: list[int] = []
    for step in range(new):
        out.append(int(logits[0].argmax()))
        if step == new - 1:
            break
        batch = make_forward_batch(runner, ForwardMode.DECODE,
                                   [BatchSeq(row, len(prompt) + step, [out[-1]])])
        logits = runner.logits_at(runner.forward(batch), torch.tensor([0]))
    release_sequence(runner, row, len(prompt) + new - 1)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face folder")
    p.add_argument("--modes", default="w8a8_int8,int8",
                   help="--quantization modes compared with the dense model (comma-separated)")
    p.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model: {args.model} is not a Hugging Face folder (no config.json)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    results: dict[str, dict] = {}
    with torch.inference_mode():
        dense = _runner(args.model, "none")
        reference = [_greedy(dense, ids, args.new_tokens) for ids in prompts]
        dense_logits = [_logits(dense, ids + ref) for ids, ref in zip(prompts, reference)]
        del dense
        for mode in args.modes.split(","):
            served = _runner(args.model, mode)
            max_err, mean_err, rel, agree = [], [], [], []
            for ids, ref, want in zip(prompts, reference, dense_logits):
                got = _logits(served, ids + ref)
                diff = (got - want).abs()
                max_err.append(float(diff.max()))
                mean_err.append(float(diff.mean()))
                rel.append(float(diff.mean() / want.std(-1).mean()))
                agree.append(float((got.argmax(-1) == want.argmax(-1)).float().mean()))
            runs = [_greedy(served, ids, args.new_tokens) for ids in prompts]
            same = [_common_prefix(r, ref) for r, ref in zip(runs, reference)]
            results[mode] = {
                "weights_mib": served.weights_bytes / 2 ** 20,
                "logit_max_abs_error": max(max_err),
                "logit_mean_abs_error": statistics.fmean(mean_err),
                "mean_error_over_logit_std": statistics.fmean(rel),
                "top1_agreement": statistics.fmean(agree),
                "identical_continuations": sum(s == args.new_tokens for s in same) / len(same),
                "mean_tokens_before_first_difference": statistics.fmean(same),
            }
            del served
    print(f"model {args.model}, bfloat16 reference, {len(prompts)} prompts, "
          f"{args.new_tokens} greedy tokens each")
    print("| mode | weights MiB | logit max abs err | mean abs err | mean err / logit std | "
          "top-1 agreement | identical continuations | tokens before first difference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(f"| {mode} | {r['weights_mib']:.0f} | {r['logit_max_abs_error']:.3f} | "
              f"{r['logit_mean_abs_error']:.4f} | {r['mean_error_over_logit_std']:.4f} | "
              f"{r['top1_agreement']:.3f} | {r['identical_continuations']:.2f} | "
              f"{r['mean_tokens_before_first_difference']:.1f} / {args.new_tokens} |")
    if args.output:
        args.output.write_text(json.dumps({"model": str(args.model), "results": results},
                                          indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
