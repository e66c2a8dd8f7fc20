"""JSON-schema decoding throughput per grammar backend against unconstrained decoding, and
jump-forward on and off, in one run.

    .venv/bin/python benchmarks/grammar.py [--prompts 16] [--output-len 96]

For each configuration (xgrammar with jump-forward, xgrammar without, llguidance, outlines) a
fresh ``sgl.Engine`` gets ``--prompts`` chat prompts at once, first unconstrained (greedy,
``--output-len`` tokens, EOS ignored), then with a JSON schema (nested object, enum, bounded
integer and strings, an array with maxItems; greedy, ends when the JSON closes). The grammar is
compiled once before timing (a warm-up request), so the numbers are decoding, not compiling.
Throughput is output tokens over the wall time of the batch; the ratio compares the constrained
run with the unconstrained run of the same engine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"enum": ["doctor", "teacher", "engineer", "artist", "farmer"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 24},
            "city": {"type": "string", "maxLength": 16},
            "country": {"type": "string", "maxLength": 16}},
            "required": ["street", "city", "country"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12},
                    "maxItems": 3},
    },
    "required": ["name", "age", "occupation", "address", "hobbies"],
}
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya"]
CONFIGS = {
    "xgrammar": {"grammar_backend": "xgrammar"},
    "xgrammar, jump-forward off": {"grammar_backend": "xgrammar", "disable_jump_forward": True},
    "llguidance": {"grammar_backend": "llguidance"},
    "outlines": {"grammar_backend": "outlines"},
}


def run(engine: Any, prompts: list[list[int]], params: dict[str, Any]) -> tuple[float, int]:
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    for r in results:
        if "json_schema" in params and r["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(r["text"])
    return seconds, sum(r["meta_info"]["completion_tokens"] for r in results)


def main() -> None:
    import sgl

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    rows = []
    for name in args.configs:
        with sgl.Engine(dtype=args.dtype, num_threads=args.threads, log_level="warning",
                        **CONFIGS[name]) as engine:
            tok = engine.tokenizer
            prompts = [list(tok.apply_chat_template(
                [{"role": "user", "content": f"Describe {NAMES[i % len(NAMES)]}, a person, "
                  "as JSON with name, age, occupation, address and hobbies."}],
                add_generation_prompt=True, tokenize=True, return_dict=False))
                for i in range(args.prompts)]
            constrained = {"max_new_tokens": args.output_len + 64, "temperature": 0,
                           "json_schema": json.dumps(SCHEMA)}
            free = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
            engine.generate(input_ids=prompts[:1], sampling_params={**constrained,
                                                                    "max_new_tokens": 4})
            engine.generate(input_ids=prompts[:1], sampling_params={**free, "max_new_tokens": 4})
            free_s, free_n = run(engine, prompts, free)
            con_s, con_n = run(engine, prompts, constrained)
            state = engine.get_server_info()["internal_states"][0]
        rows.append((name, free_n / free_s, con_n / con_s, con_n,
                     state.get("grammar_jump_forward_tokens", 0)))
        print(f"{name}: unconstrained {free_n / free_s:.1f} tok/s, constrained "
              f"{con_n / con_s:.1f} tok/s ({con_n} tokens, {rows[-1][4]} jumped)", flush=True)
    lines = [f"Machine: {platform.processor() or platform.machine()}, {args.prompts} prompts at "
             f"once, {args.dtype}, {args.threads} thread(s).", "",
             "| configuration | unconstrained tok/s | JSON-schema tok/s | ratio | output tokens "
             "| jump-forward tokens |", "| --- | --- | --- | --- | --- | --- |"]
    for name, free, con, n, jumped in rows:
        lines.append(f"| {name} | {free:.1f} | {con:.1f} | {con / free:.0%} | {n} | {jumped} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
