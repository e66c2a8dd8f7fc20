"""How far greedy decoding in bfloat16 stays with float32, in sgl and in transformers.

    .venv/bin/python benchmarks/dtype_parity.py [--tokens 64]

Sixteen chat prompts, greedy, EOS ignored: sgl runs them as one batch, transformers one by one.
For each pair of (engine, dtype) it prints how many sequences are identical and the mean length
of their common prefix (the "dtype auto" table of ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from model_throughput import load_reference, load_sgl, sgl_generate  # same folder

from sgl.model_loader import bundled_model_path, load_tokenizer

PROMPTS = (
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.", "Give me three tips for learning to cook.",
    "What is 17 times 23? Show your working.", "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?", "What causes the seasons on Earth?",
    "Name five animals that live in the ocean.", "Write a short poem about autumn leaves.",
    "Why is exercise good for health?", "Explain what a black hole is.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into French and Spanish.",
    "Describe a cat to someone who has never seen one.", "What are the primary colors?",
)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_greedy(model: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return sum(x == y for x, y in zip(a, b)), sum(prefixes) / len(prefixes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(bundled_model_path())
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS]
    pool = len(prompts) * (max(map(len, prompts)) + args.tokens) + 64
    out: dict[str, list[list[int]]] = {}
    reference = None
    for dtype, short in (("float32", "32"), ("bfloat16", "16")):
        runner = load_sgl(dtype, len(prompts), pool)
        reference = reference if reference is not None else load_reference(runner)
        out[f"sgl {dtype}"] = sgl_generate(runner, prompts, args.tokens)[2]
        model = reference if dtype == "float32" else copy.deepcopy(reference).to(torch.bfloat16)
        out[f"transformers {dtype}"] = hf_greedy(model, prompts, args.tokens)
        del runner
    for a, b in (("sgl float32", "transformers float32"),
                 ("sgl bfloat16", "transformers bfloat16"),
                 ("transformers bfloat16", "transformers float32"),
                 ("sgl bfloat16", "transformers float32")):
        same, prefix = compare(out[a], out[b])
        print(f"| {a} vs {b} | {same}/{len(prompts)} | {prefix:.1f} |")


if __name__ == "__main__":
    main()
