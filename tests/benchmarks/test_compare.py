"""benchmarks/compare without the peers: its workloads, its report (table, targets, charts, the
docs section) on a recorded run, its argument checks, and the model folder it hands to vLLM and
transformers. Nothing here starts an engine or times anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from compare import report  # noqa: E402
from compare.__main__ import _record, parse_args, server_spec  # noqa: E402
from compare.workloads import default_workloads  # noqa: E402

from sgl_bench.metrics import RequestResult, compute_metrics  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from sgl.model_loader import load_tokenizer

    return load_tokenizer(None)


def test_workloads_are_seeded_per_cell(tokenizer) -> None:
    random_w, shared_w = default_workloads(input_len=32, output_len=8, system_prompt_len=64,
                                           question_len=16)
    a = random_w.requests(tokenizer, 8, seed=0)
    assert [r.text for r in a] == [r.text for r in random_w.requests(tokenizer, 8, seed=0)]
    assert len(a) == 16 and len(random_w.requests(tokenizer, 1, seed=0)) == 8
    assert all(r.output_len == 8 and isinstance(r.prompt, str) for r in a)
    # another concurrency or workload never repeats a prompt (no prefix-cache carry-over)
    b = random_w.requests(tokenizer, 1, seed=0)
    assert not {r.text for r in a} & {r.text for r in b}
    shared = shared_w.requests(tokenizer, 32, seed=0)
    systems = {r.system for r in shared}
    assert len(shared) == 64 and len(systems) == 4
    assert all(sum(r.system == s for r in shared) == 16 for s in systems)
    assert not systems & {r.system for r in shared_w.requests(tokenizer, 8, seed=0)}


def _metrics(out_tokens_per_s: float, ttft_s: float, n: int = 4) -> dict:
    """sgl bench's metrics of a synthetic trace: n requests of 10 tokens, first token after
    ttft_s, then evenly spaced so the run lasts 10 * n / out_tokens_per_s seconds."""
    duration = 10 * n / out_tokens_per_s
    step = (duration - ttft_s) / 9
    results = [RequestResult(True, 0.0, duration, 16, 10,
                             [ttft_s + i * step for i in range(10)]) for _ in range(n)]
    return compute_metrics(results, duration)


def recorded_run() -> dict:
    cells = []
    figures = {"sgl": {1: (40.0, 0.05), 32: (400.0, 0.2)},
               "vllm": {1: (35.0, 0.08), 32: (500.0, 0.3)}}
    for engine, by_c in figures.items():
        for c, (tps, ttft) in by_c.items():
            cells.append({"engine": engine, "workload": "random", "concurrency": c,
                          "metrics": _metrics(tps, ttft)})
    return {"schema": report.SCHEMA, "date": "2026-11-29", "command": "python benchmarks/compare",
            "machine": {"summary": "2 cores"}, "concurrencies": [1, 32], "baseline": "vllm",
            "workloads": [{"name": "random", "label": "random", "description": "128 in"}],
            "engines": [{"name": "sgl", "label": "sgl", "settings": "bf16", "error": None,
                         "probe_ms": 1.5},
                        {"name": "vllm", "label": "vLLM", "settings": "bf16", "error": None},
                        {"name": "llama-server-bf16", "label": "llama-server BF16",
                         "settings": "", "error": "the build failed"}],
            "cells": cells}


def test_report_table_ratios_and_targets() -> None:
    doc = recorded_run()
    text = report.markdown(doc, {"throughput": "img/compare-throughput.png"})
    rows = [line for line in text.splitlines() if line.startswith("| sgl |")]
    assert len(rows) == 2
    cols = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cols[1] == "32" and cols[2] == "400.0" and cols[3] == "0.80x"
    assert cols[4] == "200.0"  # TTFT mean in ms
    assert "**not measured: the build failed**" in text
    assert "- sgl: bf16. Speed probe before it: 1.500 ms." in text
    assert "![throughput](img/compare-throughput.png)" in text
    verdicts = {what: met for what, _, _, met in report.targets(doc)}
    assert verdicts == {"random: output tok/s at concurrency 32": False,
                        "random: mean TTFT (ms) at concurrency 1": True}
    assert "sgl 400.0, vLLM 500.0: **not met**" in text
    json.dumps(doc)  # the results file is plain JSON


def test_docs_section_is_replaced_in_place(tmp_path: Path) -> None:
    doc_path = tmp_path / "benchmarks.md"
    doc_path.write_text("# Benchmarks\n\nintro\n")
    report.update_docs(doc_path, report.markdown(recorded_run(), {}))
    first = doc_path.read_text()
    assert first.startswith("# Benchmarks\n\nintro\n\n" + report.BEGIN)
    doc_path.write_text(first + "\n## After\n")
    later = recorded_run()
    later["date"] = "2026-12-01"
    report.update_docs(doc_path, report.markdown(later, {}))
    text = doc_path.read_text()
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert "2026-12-01" in text and "2026-11-29" not in text
    assert text.endswith("\n## After\n")


def test_charts_are_written(tmp_path: Path) -> None:
    written = report.write_charts(recorded_run(), tmp_path / "img")
    assert len(written) == 2
    for path in written.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


@pytest.mark.parametrize("argv, message", [
    (["--engines", "sgl,tgi"], "unknown engine 'tgi'"),
    (["--workloads", "sharegpt"], "unknown workload 'sharegpt'"),
    (["--concurrencies", "0,8"], "positive integers"),
    (["--concurrencies", "one"], "comma-separated list of int"),
    (["--from-results", "/nonexistent/compare.json"], "--from-results: no such file"),
    (["--sgl-dtype", "float16"], "invalid choice: 'float16'"),
])
def test_bad_arguments_name_the_flag(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("dtype, shown", [("bfloat16", "bf16"), ("auto", "dtype auto")])
def test_sgl_is_served_in_the_dtype_asked_for(dtype: str, shown: str) -> None:
    args = parse_args(["--engines", "sgl", "--sgl-dtype", dtype])
    spec = server_spec("sgl", args, SimpleNamespace(hf_folder=Path("/models/smollm2")), 30000)
    assert spec.command[spec.command.index("--dtype") + 1] == dtype
    assert spec.settings.startswith(shown + ",")


def test_sgl_gguf_serves_the_bundled_file_quantized() -> None:
    from sgl.model_loader import bundled_model_path

    args = parse_args(["--engines", "sgl,sgl-gguf,llama-server-q4_1", "--sgl-dtype", "auto"])
    peers = SimpleNamespace(hf_folder=Path("/models/smollm2"))
    dense, gguf = (server_spec(name, args, peers, 30000) for name in ("sgl", "sgl-gguf"))
    path = gguf.command[gguf.command.index("--model-path") + 1]
    assert path == str(bundled_model_path()) and gguf.name == "sgl-gguf"
    assert "--quantization" not in gguf.command  # sgl's default: the file's blocks
    assert gguf.settings.startswith("Q4_1/Q8_0 weights, dtype auto,")
    assert dense.command[dense.command.index("--model-path") + 1] == "/models/smollm2"
    args = parse_args(["--engines", "sgl,sgl-gguf", "--sgl-int8-activations", "on"])
    dense, gguf = (server_spec(name, args, peers, 30000) for name in ("sgl", "sgl-gguf"))
    at = gguf.command.index("--int8-activations")
    assert gguf.command[at + 1] == "on" and "--int8-activations" not in dense.command
    assert "int8 activations on" in gguf.settings


@pytest.mark.slow
def test_model_folder_loads_in_transformers(tmp_path: Path) -> None:
    """The folder vLLM and transformers read: the bundled GGUF's tensors in bfloat16 under
    Hugging Face names, a config with architectures, the tokenizer; written once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from compare.peers import Peers
    from sgl.model_loader import iter_weights

    peers = Peers(tmp_path)
    folder = peers.ensure_hf_folder()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert peers.ensure_hf_folder() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert AutoConfig.from_pretrained(folder).architectures == ["LlamaForCausalLM"]
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    state = model.state_dict()
    name, tensor = next(iter(iter_weights(None, torch.bfloat16)))
    assert torch.equal(state[name], tensor)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer.encode("Hello world")) .endswith("Hello world")


def test_repeated_cells_report_the_median_run_and_the_range() -> None:
    doc = recorded_run()
    doc["repeats"] = 3
    runs = {("sgl", 32): [(430.0, 0.21), (390.0, 0.19), (400.0, 0.2)],
            ("vllm", 32): [(500.0, 0.3), (520.0, 0.31), (480.0, 0.29)],
            ("sgl", 1): [(40.0, 0.05), (41.0, 0.06), (39.0, 0.04)],
            ("vllm", 1): [(35.0, 0.08), (35.5, 0.07), (36.0, 0.09)]}
    random_w = default_workloads()[0]
    doc["cells"] = []
    for (engine, c), figures in runs.items():  # as the compare records its runs
        _record(doc, engine, random_w, c, [_metrics(tps, ttft) for tps, ttft in figures])
    assert [r["output_throughput"] for r in doc["cells"][0]["runs"]] == pytest.approx(
        [430.0, 390.0, 400.0])
    text = report.markdown(doc, {})
    assert "3 runs per cell on 2026-11-29" in text
    cols = [c.strip() for c in next(line for line in text.splitlines()
                                    if line.startswith("| sgl | 32 |")).strip("|").split("|")]
    # the median run (400 tok/s, TTFT 200 ms) against vLLM's median (500), and the range
    assert cols[2] == "400.0 (390.0-430.0)" and cols[3] == "0.80x" and cols[4] == "200.0"
    verdicts = {what: met for what, _, _, met in report.targets(doc)}
    assert verdicts["random: output tok/s at concurrency 32"] is False
    # TTFT at concurrency 1 from the median-throughput runs: sgl's 40 tok/s run (50 ms)
    assert report.cell(doc, "sgl", "random", 1)["ttft_ms"]["mean"] == pytest.approx(50.0)
    json.dumps(doc)


def test_a_single_run_is_recorded_without_a_range() -> None:
    doc = recorded_run()
    doc["cells"] = []
    _record(doc, "sgl", default_workloads()[0], 32, [_metrics(400.0, 0.2)])
    assert "runs" not in doc["cells"][0]
    row = next(line for line in report.markdown(doc, {}).splitlines()
               if line.startswith("| sgl | 32 |"))
    assert "| 400.0 |" in row and "(" not in row


def test_median_run_of_an_even_count_is_a_real_run() -> None:
    measured = [_metrics(tps, 0.1) for tps in (300.0, 100.0, 400.0, 200.0)]
    assert report.median_run(measured)["output_throughput"] == pytest.approx(200.0)
    assert report.median_run(measured[:1]) is measured[0]
    with pytest.raises(ValueError, match="at least one run"):
        report.median_run([])


def test_repeats_must_be_positive(capsys) -> None:
    assert parse_args(["--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
    assert "--repeats: give a positive number of runs per cell, not 0" in capsys.readouterr().err
