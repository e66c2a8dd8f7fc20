"""Speculative decoding on and off, in one run: output tokens/s on copy-heavy prompts.

    .venv/bin/python benchmarks/speculative.py [--dtype float32] [--concurrency 1,8,32]

The prompts ask SmolLM2 to repeat a paragraph, to copy a list, to rewrite a piece of code and to
quote passages of a text: outputs that repeat spans of their prompt, where n-gram drafting pays.
Two ``sgl.Engine`` instances run in turns, one with ``--speculative-algorithm`` (and
``speculative_disable_by_batch_size`` high, so that every concurrency is measured with
speculation on), one without. At concurrency c, c requests are sent at once and the batch's
output tokens are counted over its wall time; greedy, EOS ends a request (the texts are
compared: they must be identical). Median of ``--reps`` alternating runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

PARAGRAPHS = [
    "The committee met on Tuesday to review the budget. It approved the new library, the "
    "repairs to the bridge and the summer festival, and it postponed the parking plan until "
    "the spring.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It takes place mainly in the leaves.",
    "To reset the router, unplug it for thirty seconds, plug it back in, wait for the light "
    "to turn green, and then connect to the network named in the label on its back.",
    "Marie Curie was a physicist and chemist who conducted pioneering research on "
    "radioactivity. She was the first woman to win a Nobel Prize.",
]
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n")


def copy_prompts() -> list[str]:
    prompts = []
    for p in PARAGRAPHS:
        prompts.append(f"Repeat this text exactly, word for word:\n\n{p}")
        prompts.append(f'Quote the first two sentences of this passage:\n\n"{p}"')
    prompts.append(f"Rewrite this Python function with type hints, keep the rest:\n\n{CODE}")
    prompts.append("Copy this list: apples, pears, plums, cherries, grapes, melons, lemons, "
                   "limes, figs, dates, kiwis, mangoes.")
    return prompts


#: the JSON workload: field names and structure the output repeats from the schema
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 24},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                               "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"],
}


def json_prompts() -> list[str]:
    return [f"Describe person number {i} of a novel as JSON with name, age, city and hobbies."
            for i in range(1, 11)]


def chat(engine: Any, text: str) -> list[int]:
    ids = engine.tokenizer_manager.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_batch(engine: Any, prompts: list[list[int]], max_new_tokens: int,
              extra: dict[str, Any] | None = None) -> tuple[float, list[dict[str, Any]]]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, **(extra or {})}
    start = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="NGRAM")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--ngram-breadth", type=int, default=None,
                    help="NGRAM's --speculative-ngram-max-bfs-breadth (above 1: token trees)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workload", choices=["copy", "json"], default="copy",
                    help="copy: prompts whose answers repeat their text; json: JSON-schema "
                    "decoding (the outputs are checked to parse)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import sgl

    common = {"dtype": args.dtype, "log_level": "warning"}
    spec_settings = {"speculative_algorithm": args.algorithm,
                     "speculative_disable_by_batch_size": 1024}
    if args.num_draft_tokens:
        spec_settings["speculative_num_draft_tokens"] = args.num_draft_tokens
    if args.ngram_breadth:
        spec_settings["plugins"] = {"speculative-ngram": {"max_bfs_breadth": args.ngram_breadth}}
    engines = {"off": sgl.Engine(**common), "on": sgl.Engine(**common, **spec_settings)}
    texts = copy_prompts() if args.workload == "copy" else json_prompts()
    extra = {"json_schema": json.dumps(PERSON_SCHEMA)} if args.workload == "json" else None
    base = [chat(engines["off"], t) for t in texts]
    rows = []
    try:
        for c in [int(x) for x in args.concurrency.split(",")]:
            prompts = [base[i % len(base)] for i in range(c)]
            times: dict[str, list[float]] = {"off": [], "on": []}
            outputs: dict[str, list[dict[str, Any]]] = {}
            for name, engine in engines.items():  # warm-up: one request
                run_batch(engine, prompts[:1], 8, extra)
            for _ in range(args.reps):
                for name, engine in engines.items():
                    if c == 1:  # one request after the other
                        seconds, outs = 0.0, []
                        for p in base[:4]:
                            dt, out = run_batch(engine, [p], args.max_new_tokens, extra)
                            seconds += dt
                            outs += out
                    else:
                        seconds, outs = run_batch(engine, prompts, args.max_new_tokens, extra)
                    times[name].append(seconds)
                    outputs[name] = outs
            if args.workload == "json":
                for o in outputs["on"] + outputs["off"]:
                    json.loads(o["text"])  # valid (raises if not)
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs["off"])
            same = sum(a["output_ids"] == b["output_ids"]
                       for a, b in zip(outputs["off"], outputs["on"]))
            accept = statistics.mean(o["meta_info"].get("spec_accept_length", 1.0)
                                     for o in outputs["on"])
            off, on = (tokens / statistics.median(times[k]) for k in ("off", "on"))
            rows.append({"concurrency": c, "tokens": tokens, "off_tok_s": off, "on_tok_s": on,
                         "speedup": on / off, "accept_length": accept,
                         "identical": f"{same}/{len(outputs['off'])}"})
            print(f"concurrency {c:3d}: off {off:7.1f} tok/s, {args.algorithm} {on:7.1f} tok/s "
                  f"({on / off:.2f}x), accept length {accept:.2f}, identical {same}/"
                  f"{len(outputs['off'])}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print("\n| concurrency | off tok/s | on tok/s | on / off | accept length | identical |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | "
              f"**{r['speedup']:.2f}x** | {r['accept_length']:.2f} | {r['identical']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
