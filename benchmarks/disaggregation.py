"""Prefill/decode disaggregation on one machine: a prefill and a decode server behind SGLang's
router in PD mode, next to one plain server, on the random and shared-prefix workloads.

    .venv/bin/python benchmarks/disaggregation.py [--backends tcp,mooncake]
        [--concurrency 8] [--num-prompts 32] [-- sgl serve args]

For each setup, in one run (the baseline is measured in the same run: the machine is shared
and noisy): one ``sgl serve`` on all cores, then for each backend ``sgl serve
--disaggregation-mode prefill`` on the first half of the cores and ``decode`` on the second
half, with ``sgl router --pd-disaggregation`` in front. Each setup runs ``sgl bench serving
--backend sgl`` twice: random (256 tokens in, 64 out) and generated-shared-prefix (4 groups,
512-token system prompt, 32-token question, 64 out), at ``--concurrency``. Reported: output
tokens/s (and the ratio to the one server), mean TTFT, median and p99 ITL, and per request the
KV bytes and seconds the decode server's counters say were moved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

WORKLOADS = {
    "random": ["--dataset", "random", "--random-input-len", "256", "--random-output-len", "64",
               "--random-range-ratio", "1.0"],
    "shared prefix": ["--dataset", "generated-shared-prefix", "--gsp-num-groups", "4",
                      "--gsp-system-prompt-len", "512", "--gsp-question-len", "32",
                      "--gsp-output-len", "64"],
}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cores_half(index: int) -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return cores[:half] if index == 0 else (cores[half:] or cores)


@contextmanager
def serve(args: list[str], log: Path, cores: list[int] | None = None) -> Iterator[str]:
    port = free_port()
    out = open(log, "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "sgl", "serve", "--port", str(port), *args], stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"sgl serve exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        out.close()


@contextmanager
def router(prefill: str, decode: str, log: Path) -> Iterator[str]:
    port = free_port()
    out = open(log, "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "sgl", "router", "--pd-disaggregation",
                             "--prefill", prefill, "--decode", decode, "--port", str(port),
                             "--prometheus-port", str(free_port())],
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        while "sgl router is ready" not in log.read_text():
            if proc.poll() is not None:
                raise SystemExit(f"sgl router exited:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        out.close()


def bench(url: str, workload: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    result = workdir / f"bench-{time.monotonic_ns()}.jsonl"
    subprocess.run([sys.executable, "-m", "sgl", "bench", "serving", "--backend", "sgl",
                    "--base-url", url, *WORKLOADS[workload], "--num-prompts",
                    str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                    "--seed", "1", "--output-file", str(result), "--disable-tqdm"],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text().splitlines()[-1])


def transfers(url: str) -> dict[str, float]:
    state = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
    return {k: state[k] for k in ("kv_transfers", "kv_transfer_bytes", "kv_transfer_seconds")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="tcp,mooncake")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("serve_args", nargs="*", help="after --: sgl serve arguments of every server")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="sgl-pd-bench-"))
    rows: list[tuple[str, str, dict[str, Any], dict[str, float] | None]] = []
    with serve(args.serve_args, workdir / "one.log") as url:
        for workload in WORKLOADS:
            rows.append(("one server", workload, bench(url, workload, args, workdir), None))
    for backend in args.backends.split(","):
        pd_args = [*args.serve_args, "--disaggregation-transfer-backend", backend]
        bootstrap = free_port()
        with serve([*pd_args, "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(bootstrap)],
                   workdir / f"prefill-{backend}.log", cores_half(0)) as prefill, \
                serve([*pd_args, "--disaggregation-mode", "decode"],
                      workdir / f"decode-{backend}.log", cores_half(1)) as decode, \
                router(prefill, decode, workdir / f"router-{backend}.log") as url:
            for workload in WORKLOADS:
                before = transfers(decode)
                result = bench(url, workload, args, workdir)
                after = transfers(decode)
                moved = {k: after[k] - before[k] for k in after}
                rows.append((f"PD, {backend}", workload, result, moved))
    base = {workload: r for setup, workload, r, _ in rows if setup == "one server"}
    print(f"\nconcurrency {args.concurrency}, {args.num_prompts} prompts; PD: prefill and "
          f"decode server on half the cores each; logs in {workdir}")
    print("| setup | workload | output tok/s | vs one server | mean TTFT (ms) | median ITL (ms) "
          "| p99 ITL (ms) | KV per request | transfer time per request |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for setup, workload, r, moved in rows:
        ratio = r["output_throughput"] / base[workload]["output_throughput"]
        kv = per = "-"
        if moved and moved["kv_transfers"]:
            kv = f"{moved['kv_transfer_bytes'] / moved['kv_transfers'] / 2**20:.2f} MiB"
            per = f"{moved['kv_transfer_seconds'] / moved['kv_transfers'] * 1000:.1f} ms"
        print(f"| {setup} | {workload} | {r['output_throughput']:.1f} | {ratio:.2f}x | "
              f"{r['mean_ttft_ms']:.0f} | {r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | "
              f"{kv} | {per} |")


if __name__ == "__main__":
    main()
