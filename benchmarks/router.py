"""SGLang's router in front of two sgl workers (``sgl router --workers 2``): the prefix-cache
hit rate and the throughput of its ``cache_aware`` policy against ``round_robin`` on a
shared-prefix workload.

    .venv/bin/python benchmarks/router.py [--policies round_robin,cache_aware]
        [--groups 6] [--prompts-per-group 8] [--concurrency 8] [-- sgl serve args]

For each policy: ``sgl router --workers 2 --policy P`` (two workers, one core each, the bundled
model by default), then ``sgl bench serving --backend sgl --dataset generated-shared-prefix``
through the router; the hit rate is the workers' ``sgl:cached_tokens_total`` over their
``sgl:prompt_tokens_total`` (from each worker's ``/metrics``), the rest is sgl bench's.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def run_policy(policy: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    port = free_port()
    log = workdir / f"router-{policy}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sgl", "router", "--workers", "2",
                                 "--policy", policy, "--port", str(port), "--prometheus-port",
                                 str(free_port()), "--", *args.serve_args],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        while "sgl router is ready" not in log.read_text():
            if proc.poll() is not None:
                raise SystemExit(f"sgl router exited:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        workers = re.findall(r"worker \d of 2: (http://127\.0\.0\.1:\d+)", log.read_text())
        result = workdir / f"bench-{policy}.jsonl"  # one line per run
        subprocess.run([sys.executable, "-m", "sgl", "bench", "serving", "--backend", "sgl",
                        "--base-url", f"http://127.0.0.1:{port}", "--dataset",
                        "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
                        "--gsp-prompts-per-group", str(args.prompts_per_group),
                        "--gsp-system-prompt-len", "512", "--gsp-question-len", "32",
                        "--gsp-output-len", "32", "--max-concurrency", str(args.concurrency),
                        "--output-file", str(result), "--disable-tqdm"], check=True,
                       stdout=subprocess.DEVNULL)
        cached = [metric(w, "sgl:cached_tokens_total") for w in workers]
        prompt = [metric(w, "sgl:prompt_tokens_total") for w in workers]
        bench = json.loads(result.read_text().splitlines()[-1])
        return {"hit rate": sum(cached) / sum(prompt),
                "requests per worker": [int(p) for p in prompt],
                "output tok/s": bench.get("output_throughput", float("nan")),
                "mean TTFT ms": bench.get("mean_ttft_ms", float("nan"))}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="round_robin,cache_aware")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("serve_args", nargs="*", help="after --: sgl serve arguments of the workers")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="sgl-router-bench-"))
    rows = {policy: run_policy(policy, args, workdir) for policy in args.policies.split(",")}
    print(f"\n{args.groups} groups x {args.prompts_per_group} prompts (512-token shared prefix, "
          f"32 own, 32 out), concurrency {args.concurrency}, 2 workers")
    print("| policy | prefix-cache hit rate | prompt tokens per worker | output tok/s | mean TTFT (ms) |")
    print("|---|---:|---|---:|---:|")
    for policy, row in rows.items():
        print(f"| {policy} | {row['hit rate']:.1%} | {row['requests per worker']} | "
              f"{row['output tok/s']:.1f} | {row['mean TTFT ms']:.0f} |")


if __name__ == "__main__":
    main()
