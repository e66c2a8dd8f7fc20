"""Greedy outputs of the bundled model, recorded so that two trees can be compared byte for byte.

A change that reshapes the scheduler must not change a token. This script serves the bundled
model in each configuration (float32 and bfloat16; plain, with n-gram speculation, and
disaggregated over the tcp backend), sends the same prompts (some sharing prefixes, sent at once
so that they batch and hit the prefix cache, then again) and writes every output's token ids to
a JSON file. Run it on the tree before and after a change and compare the files::

    python benchmarks/greedy_snapshot.py --out /tmp/before.json     # on the old tree
    python benchmarks/greedy_snapshot.py --out /tmp/after.json      # on the new tree
    python benchmarks/greedy_snapshot.py --compare /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from sgl_testing import ServerProcess, free_port

CONFIGS: dict[str, list[str]] = {
    "float32": ["--dtype", "float32"],
    "bfloat16": ["--dtype", "bfloat16"],
    "float32-ngram": ["--dtype", "float32", "--speculative-algorithm", "NGRAM"],
    "bfloat16-ngram": ["--dtype", "bfloat16", "--speculative-algorithm", "NGRAM"],
}
DISAGGREGATED = ("float32", "bfloat16")


def prompts(seed: int = 0, n: int = 12) -> list[dict[str, Any]]:
    """Chat-like and repetitive prompts (n-gram drafts find matches in the second kind), half
    of them sharing a long prefix."""
    rng = random.Random(seed)
    topics = ["the sea", "a red bicycle", "prime numbers", "how bread rises", "the moon",
              "a lighthouse keeper", "sorting algorithms", "autumn leaves"]
    shared = "You are a careful assistant. Answer in two sentences, plainly. " * 4
    out = []
    for i in range(n):
        topic = rng.choice(topics)
        text = (f"{shared}Tell me about {topic}." if i % 2 else
                f"Repeat after me: {topic}, {topic}, {topic}. Now say it once more:")
        out.append({"text": text, "sampling_params": {
            "temperature": 0, "max_new_tokens": 48, "ignore_eos": i % 3 == 0}})
    return out


def run_server(args: list[str], bodies: list[dict[str, Any]], logs: Path) -> list[list[int]]:
    server = ServerProcess(*args, log_path=logs / "server.log")
    try:
        return _send_twice(lambda body: _post(server.base_url, body), bodies)
    finally:
        server.stop()


def run_disaggregated(args: list[str], bodies: list[dict[str, Any]],
                      logs: Path) -> list[list[int]]:
    port = free_port()
    common = [*args, "--disaggregation-transfer-backend", "tcp"]
    with ThreadPoolExecutor(2) as pool:
        prefill_f = pool.submit(ServerProcess, *common, "--disaggregation-mode", "prefill",
                                "--disaggregation-bootstrap-port", str(port),
                                log_path=logs / "prefill.log")
        decode_f = pool.submit(ServerProcess, *common, "--disaggregation-mode", "decode",
                               log_path=logs / "decode.log")
        prefill, decode = prefill_f.result(), decode_f.result()
    try:
        def both(body: dict[str, Any]) -> list[int]:
            body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                    "bootstrap_room": random.getrandbits(63)}
            with ThreadPoolExecutor(2) as sides:
                first = sides.submit(_post, prefill.base_url, body)
                tokens = sides.submit(_post, decode.base_url, body).result()
                first.result()
            return tokens

        return _send_twice(both, bodies)
    finally:
        prefill.stop()
        decode.stop()


def _send_twice(send: Any, bodies: list[dict[str, Any]]) -> list[list[int]]:
    """All prompts at once (batched, sharing prefixes), then again (cache hits)."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        first = list(pool.map(send, bodies))
    second = [send(body) for body in bodies]
    return first + second


def _post(base_url: str, body: dict[str, Any]) -> list[int]:
    reply = httpx.post(f"{base_url}/generate", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()["output_ids"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where to write the outputs (JSON)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="compare two files written by --out; exit 1 where they differ")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        differ = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
        for key in sorted(before):
            print(f"{key}: {'DIFFERS' if key in differ else 'identical'} "
                  f"({len(before[key])} outputs)")
        return 1 if differ else 0
    if args.out is None:
        parser.error("give --out FILE or --compare BEFORE AFTER")
    bodies = prompts()
    results: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            logs = Path(tmp) / name
            logs.mkdir()
            results[name] = run_server(config, bodies, logs)
            print(f"{name}: {sum(map(len, results[name]))} tokens", flush=True)
        for name in DISAGGREGATED:
            logs = Path(tmp) / f"pd-{name}"
            logs.mkdir()
            results[f"{name}-disaggregated"] = run_disaggregated(CONFIGS[name], bodies, logs)
            print(f"{name}-disaggregated: done", flush=True)
    args.out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
