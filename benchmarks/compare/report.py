"""The comparison's results file, its Markdown table, its charts and the docs section.

The results document (schema ``sgl-compare/1``)::

    {"schema", "date", "command",
     "model": {"name", "label", "origin", "source", "description", "shape", "parameters",
               "kv_bytes_per_token"},
     "roofline": {benchmarks/roofline.py's Roofline},
     "machine": {...}, "concurrencies": [1, 8, 32],
     "repeats": 3, "baseline": "vllm",
     "workloads": [{"name", "label", "description", "prompt_len", "output_len"}],
     "engines": [{"name", "label", "settings", "error", "weight_bytes", "compute"}],
     "cells": [{"engine", "workload", "concurrency", "metrics": {sgl bench metrics},
                "runs": [{"output_throughput", "ttft_mean_ms"}, ...]}]}

With more than one run per cell (``--repeats``), ``metrics`` are those of the run with the
median output throughput (the lower middle one of an even count: every figure of a row then
comes from one real run) and ``runs`` summarizes them all; a file without ``repeats`` or
``runs`` holds one run per cell, and one without ``model`` (written before ``--model``) is of
the bundled SmolLM2-135M (:data:`SMOLLM2`).

Every model has its own block in the docs (between :func:`markers`) and its own charts; the
bundled model's keep the names they had before ``--model``.

Everything here is a pure function of that document, so it is tested on a recorded one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SCHEMA = "sgl-compare/1"
BEGIN = "<!-- compare:begin (written by benchmarks/compare; do not edit by hand) -->"
END = "<!-- compare:end -->"
#: the ``model`` of a results file written before ``--model``
SMOLLM2 = {"name": "smollm2", "label": "SmolLM2-135M-Instruct",
           "description": "the bundled GGUF dequantized to one bfloat16 Hugging Face folder; "
                          "llama-server reads GGUFs converted from that folder"}


def model_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The model a results document is for."""
    return doc.get("model") or SMOLLM2


def _suffix(doc: dict[str, Any]) -> str:
    name = model_of(doc)["name"]
    return "" if name == "smollm2" else f"-{name}"


def markers(doc: dict[str, Any]) -> tuple[str, str]:
    """The lines around the model's block in the docs."""
    name = model_of(doc)["name"]
    if name == "smollm2":
        return BEGIN, END
    return (BEGIN.replace("compare:begin", f"compare:begin {name}"),
            END.replace("compare:end", f"compare:end {name}"))


def _entry(doc: dict[str, Any], engine: str, workload: str,
           concurrency: int) -> dict[str, Any] | None:
    for c in doc["cells"]:
        if (c["engine"], c["workload"], c["concurrency"]) == (engine, workload, concurrency):
            return c
    return None


def cell(doc: dict[str, Any], engine: str, workload: str, concurrency: int) -> dict[str, Any] | None:
    """The metrics of a cell (of its median run), or None when it was not measured."""
    entry = _entry(doc, engine, workload, concurrency)
    return entry["metrics"] if entry else None


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of the run with the median output throughput (the lower middle one of an
    even count)."""
    if not runs:
        raise ValueError("a cell needs at least one run")
    ranked = sorted(runs, key=lambda m: m["output_throughput"])
    return ranked[(len(ranked) - 1) // 2]


def run_summary(m: dict[str, Any]) -> dict[str, Any]:
    """What a cell keeps of each of its runs."""
    return {"output_throughput": m["output_throughput"], "ttft_mean_ms": m["ttft_ms"]["mean"]}


def _throughput(doc: dict[str, Any], engine: str, workload: str, concurrency: int,
                m: dict[str, Any]) -> str:
    """The median run's output tokens/s, and the range of the cell's runs when it has several."""
    text = number(m["output_throughput"])
    entry = _entry(doc, engine, workload, concurrency) or {}
    runs = [r["output_throughput"] for r in entry.get("runs", [])]
    if len(runs) > 1:
        text += f" ({min(runs):,.1f}-{max(runs):,.1f})"
    return text


def number(value: Any, digits: int = 1) -> str:
    """``value`` with thousands separators and ``digits`` decimals; ``-`` when missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(value: Any, base: Any) -> str:
    if not value or not base:
        return "-"
    return f"{value / base:.2f}x"


def decode_rate(doc: dict[str, Any], engine: dict[str, Any], workload: dict[str, Any],
                concurrency: int, m: dict[str, Any]) -> tuple[float, float] | None:
    """GB/s a cell's decode steps read (every weight once a step, and each of ``concurrency``
    sequences' KV cache at its mean length) and that as a fraction of the machine's bandwidth;
    None without a roofline or the facts it needs."""
    roof, tpot = doc.get("roofline"), m["tpot_ms"]["mean"]
    kv, weights = model_of(doc).get("kv_bytes_per_token"), engine.get("weight_bytes")
    if not roof or not tpot or kv is None or weights is None or "prompt_len" not in workload:
        return None
    length = workload["prompt_len"] + workload["output_len"] / 2
    rate = (weights + concurrency * length * kv) * (1000.0 / tpot) / 1e9
    return rate, rate / roof["bandwidth_gbs"]


def prefill_rate(doc: dict[str, Any], engine: dict[str, Any], workload: dict[str, Any],
                 m: dict[str, Any]) -> tuple[float, float] | None:
    """GFLOP/s of a prefill (2 per parameter and prompt token over the mean TTFT, so only at
    concurrency 1, where nothing waits) and that as a fraction of the machine's matmul peak in
    the engine's compute type (bfloat16; int8 for quantized GGUF files)."""
    roof, ttft = doc.get("roofline"), m["ttft_ms"]["mean"]
    params = model_of(doc).get("parameters")
    if not roof or not ttft or not params or "prompt_len" not in workload:
        return None
    rate = 2.0 * params * workload["prompt_len"] / (ttft / 1000.0) / 1e9
    peak = roof["peak_gflops"].get(engine.get("compute", "bfloat16"))
    return rate, rate / peak if peak else float("nan")


def _roofline_columns(doc: dict[str, Any], engine: dict[str, Any], workload: dict[str, Any],
                      concurrency: int, m: dict[str, Any]) -> str:
    decode = decode_rate(doc, engine, workload, concurrency, m)
    prefill = prefill_rate(doc, engine, workload, m) if concurrency == 1 else None
    text = [f"{decode[0]:.1f} ({decode[1]:.0%})" if decode else "-",
            f"{prefill[0]:.0f} ({prefill[1]:.0%})" if prefill else "-"]
    return " | ".join(text) + " |"


def targets(doc: dict[str, Any]) -> list[tuple[str, float | None, float | None, bool | None]]:
    """The issue's two targets against the baseline, per workload: (what, sgl, baseline, met).
    Output throughput at the highest concurrency is met when sgl >= baseline; TTFT at the lowest
    concurrency when sgl <= baseline."""
    base = doc.get("baseline")
    out: list[tuple[str, float | None, float | None, bool | None]] = []
    if not base or not doc["concurrencies"]:
        return out
    hi, lo = max(doc["concurrencies"]), min(doc["concurrencies"])
    for w in doc["workloads"]:
        s, b = cell(doc, "sgl", w["name"], hi), cell(doc, base, w["name"], hi)
        sv = s["output_throughput"] if s else None
        bv = b["output_throughput"] if b else None
        out.append((f"{w['label']}: output tok/s at concurrency {hi}", sv, bv,
                    None if sv is None or bv is None else sv >= bv))
        s, b = cell(doc, "sgl", w["name"], lo), cell(doc, base, w["name"], lo)
        sv = s["ttft_ms"]["mean"] if s else None
        bv = b["ttft_ms"]["mean"] if b else None
        out.append((f"{w['label']}: mean TTFT (ms) at concurrency {lo}", sv, bv,
                    None if sv is None or bv is None else sv <= bv))
    return out


def markdown(doc: dict[str, Any], chart_paths: dict[str, str]) -> str:
    """The docs section: how it was run, one table per workload, the targets, the charts."""
    base = doc.get("baseline")
    labels = {e["name"]: e["label"] for e in doc["engines"]}
    repeats = doc.get("repeats", 1)
    where = f"on {doc['date']}, {doc['machine'].get('summary', '')}"
    runs = (f"One run {where}." if repeats == 1 else
            f"{repeats} runs per cell {where}: a row gives the run with the median output "
            "tokens/s, and in brackets the range of the cell's runs; each run has its own "
            "prompts, the same for every engine.")
    model = model_of(doc)
    begin, end = markers(doc)
    lines = [begin, "", f"### sgl next to vLLM, llama-server and transformers: {model['label']}",
             "", f"{runs} Command:", "", "```", doc["command"], "```", ""]
    shape = f" Shape: {model['shape']}." if model.get("shape") else ""
    lines.append(f"Engines, each alone on the machine while measured, all on {model['label']} "
                 f"({model['description']}).{shape}")
    lines.append("")
    for e in doc["engines"]:
        state = f" **not measured: {e['error']}**" if e.get("error") else ""
        probe = (f" Speed probe before it: {e['probe_ms']:.3f} ms."
                 if e.get("probe_ms") is not None else "")
        lines.append(f"- {e['label']}: {e['settings']}.{probe}{state}")
    if any(e.get("probe_ms") is not None for e in doc["engines"]):
        lines += ["", "The speed probe is one fixed float32 matmul on one thread (median of 15), "
                  "timed just before each engine starts: the machine is shared, and a probe that "
                  "differs between engines means their rows were measured on a slower or "
                  "faster machine."]
    lines += ["", "Workloads: every request through `POST /v1/completions` (streamed, "
              "`temperature 0`, `ignore_eos`), at most *concurrency* in flight; sgl bench's "
              "client and metrics for every server."]
    for w in doc["workloads"]:
        lines.append(f"- {w['label']}: {w['description']}.")
    lines.append("")
    roof = doc.get("roofline")
    if roof:
        peaks = ", ".join(f"{name} {rate:,.0f} {'GOP/s' if name == 'int8' else 'GFLOP/s'}"
                          for name, rate in roof["peak_gflops"].items())
        lines += [f"Roofline of this machine on {roof['threads']} thread(s) "
                  f"(`benchmarks/roofline.py`, measured at the start of the run): memory "
                  f"{roof['bandwidth_gbs']:.1f} GB/s; matmul peaks {peaks}. *Decode GB/s*: "
                  "the weights (the file the engine serves) plus every sequence's KV cache at "
                  "its mean length, read once per decode step (1000 / TPOT steps a second), "
                  "and in brackets the fraction of the bandwidth. *Prefill GFLOP/s* (at "
                  "concurrency 1): 2 FLOPs per parameter and prompt token over the mean TTFT, "
                  "and in brackets the fraction of the matmul peak of the engine's compute type "
                  "(bfloat16; int8 for quantized GGUF files).", ""]
    for w in doc["workloads"]:
        vs = f"vs {labels.get(base, base)}" if base else "ratio"
        extra = " Decode GB/s | Prefill GFLOP/s |" if roof else ""
        lines += [f"#### {w['label']}", "",
                  f"| Engine | Concurrency | Output tok/s | {vs} | TTFT mean (ms) | "
                  f"TTFT p99 (ms) | ITL median (ms) | TPOT mean (ms) | OK / failed |{extra}",
                  "|---|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|--:|" if roof else "")]
        for e in doc["engines"]:
            for c in doc["concurrencies"]:
                m = cell(doc, e["name"], w["name"], c)
                if m is None:
                    continue
                b = cell(doc, base, w["name"], c) if base else None
                lines.append(
                    f"| {e['label']} | {c} | {_throughput(doc, e['name'], w['name'], c, m)} | "
                    f"{_ratio(m['output_throughput'], b and b['output_throughput'])} | "
                    f"{number(m['ttft_ms']['mean'])} | {number(m['ttft_ms']['p99'])} | "
                    f"{number(m['itl_ms']['median'])} | {number(m['tpot_ms']['mean'])} | "
                    f"{m['completed']} / {m['failed']} |"
                    + (f" {_roofline_columns(doc, e, w, c, m)}" if roof else ""))
        lines.append("")
    checks = targets(doc)
    if checks:
        lines += [f"Targets (sgl against {labels.get(base, base)}, same run):", ""]
        for what, sv, bv, met in checks:
            verdict = {True: "met", False: "**not met**", None: "not measured"}[met]
            lines.append(f"- {what}: sgl {number(sv)}, {labels.get(base, base)} {number(bv)}: "
                         f"{verdict}")
        lines.append("")
    for title, path in chart_paths.items():
        lines += [f"![{title}]({path})", ""]
    lines.append(end)
    return "\n".join(lines) + "\n"


def write_charts(doc: dict[str, Any], img_dir: Path) -> dict[str, Path]:
    """Output throughput and mean TTFT against concurrency, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    charts = {"output throughput versus concurrency": ("output_throughput", None,
                                                       "output tokens/s", False,
                                                       f"compare{_suffix(doc)}-throughput.png"),
              "mean TTFT versus concurrency": ("ttft_ms", "mean", "mean TTFT (ms, log scale)",
                                               True, f"compare{_suffix(doc)}-ttft.png")}
    written: dict[str, Path] = {}
    for title, (key, sub, ylabel, log, filename) in charts.items():
        fig, axes = plt.subplots(1, len(doc["workloads"]), figsize=(5.5 * len(doc["workloads"]),
                                                                     4.2), squeeze=False)
        for ax, w in zip(axes[0], doc["workloads"]):
            for e in doc["engines"]:
                xs, ys = [], []
                for c in doc["concurrencies"]:
                    m = cell(doc, e["name"], w["name"], c)
                    value = m and (m[key][sub] if sub else m[key])
                    if value:
                        xs.append(c)
                        ys.append(value)
                if xs:
                    ax.plot(xs, ys, marker="o", label=e["label"],
                            linewidth=2.5 if e["name"] == "sgl" else 1.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(doc["concurrencies"], [str(c) for c in doc["concurrencies"]])
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_title(w["label"])
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{model_of(doc)['label']}, {title} ({doc['date']})")
        fig.tight_layout()
        path = img_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written[title] = path
    return written


def update_docs(doc_path: Path, section: str) -> None:
    """Replace the block between the section's markers; a new model's block goes after the
    last compare block (or at the end of the file)."""
    begin, end = section.splitlines()[0], section.rstrip("\n").splitlines()[-1]
    text = doc_path.read_text() if doc_path.exists() else ""
    start, stop = text.find(begin), text.find(end)
    if start >= 0 and stop > start:
        text = text[:start] + section.rstrip("\n") + text[stop + len(end):]
    elif "<!-- compare:end" in text:
        at = text.index("-->", text.rindex("<!-- compare:end")) + len("-->")
        text = text[:at] + "\n\n" + section.rstrip("\n") + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc_path.write_text(text)
