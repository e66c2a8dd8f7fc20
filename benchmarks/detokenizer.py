"""Incremental detokenization, one token at a time, on the bundled SmolLM2 tokenizer:
tokenizers' ``DecodeStream`` path against the Python window-decoding path, in one run.

    .venv/bin/python benchmarks/detokenizer.py [--reps 5]

Prints microseconds per token for each path and whether both wrote the full decode's text.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sgl.model_loader import load_tokenizer
from sgl.server.detokenizer import IncrementalDetokenizer

TEXT = ("Hello wörld! Emojis 🎉🚀 and 中文字符 mixed with code: def f(x): return x**2\n" * 40)


def per_token_us(tokenizer: object, prompt: list[int], ids: list[int],
                 use_stream: bool) -> tuple[float, str]:
    start = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, prompt, use_stream=use_stream)
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    return (time.perf_counter() - start) * 1e6 / len(ids), text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("The answer:", add_special_tokens=False)
    full = tokenizer.decode(ids)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.reps):
        for use_stream in (True, False):
            us, text = per_token_us(tokenizer, prompt, ids, use_stream)
            assert text == full, "the pieces do not add up to the full decode"
            times[use_stream].append(us)
    stream, python = (statistics.median(times[k]) for k in (True, False))
    print(f"{len(ids)} tokens, median of {args.reps}")
    print(f"DecodeStream path: {stream:.1f} us/token")
    print(f"Python path:       {python:.1f} us/token  ({python / stream:.1f}x the DecodeStream "
          f"path)")


if __name__ == "__main__":
    main()
