"""benchmarks/compare without the peers: its workloads, its report (table, targets, charts, the
docs section) on a recorded run, its argument checks, the ladder's shapes, and the model folders
it hands to vLLM, transformers and sgl. Nothing here builds llama.cpp or vLLM or times anything;
one test serves a tiny ladder-like folder with sgl.Engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from compare import hf_folder, report  # noqa: E402
from compare.__main__ import _record, parse_args, prepare, server_spec  # noqa: E402
from compare.ladder import LADDER, ladder_config  # noqa: E402
from compare.models import resolve_model  # noqa: E402
from compare.peers import Peers  # noqa: E402
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


def test_roofline_columns_are_the_bytes_and_flops_over_the_machine_limits() -> None:
    doc = recorded_run()
    assert "Decode GB/s" not in report.markdown(doc, {})  # an older file: no roofline
    doc["roofline"] = {"threads": 2, "peak_gflops": {"bfloat16": 500.0, "int8": 1000.0},
                       "peak_by": {}, "bandwidth_gbs": 40.0, "bandwidth_by": "sum", "isa": "x"}
    doc["model"] = {**report.SMOLLM2, "parameters": 1e9, "kv_bytes_per_token": 32768}
    doc["workloads"][0].update(prompt_len=128, output_len=128)
    doc["engines"][0].update(weight_bytes=2e9, compute="bfloat16")
    sgl = next(e for e in doc["engines"] if e["name"] == "sgl")
    work = doc["workloads"][0]
    m = report.cell(doc, "sgl", "random", 32)
    gbs, part = report.decode_rate(doc, sgl, work, 32, m)
    steps = 1000.0 / m["tpot_ms"]["mean"]
    assert gbs == pytest.approx((2e9 + 32 * 192 * 32768) * steps / 1e9)
    assert part == pytest.approx(gbs / 40.0)
    first = report.cell(doc, "sgl", "random", 1)
    gflops, of_peak = report.prefill_rate(doc, sgl, work, first)
    assert gflops == pytest.approx(2e9 * 128 / (first["ttft_ms"]["mean"] / 1000) / 1e9)
    assert of_peak == pytest.approx(gflops / 500.0)
    text = report.markdown(doc, {})
    assert "memory 40.0 GB/s; matmul peaks bfloat16 500 GFLOP/s, int8 1,000 GOP/s" in text
    row = next(line for line in text.splitlines() if line.startswith("| sgl | 32 |"))
    assert row.endswith(f"| {gbs:.1f} ({part:.0%}) | - |")  # prefill only at concurrency 1
    vllm = next(line for line in text.splitlines() if line.startswith("| vLLM | 1 |"))
    v_gflops, v_part = report.prefill_rate(doc, doc["engines"][1], work,
                                           report.cell(doc, "vllm", "random", 1))
    assert vllm.endswith(f"| - | {v_gflops:.0f} ({v_part:.0%}) |")  # no weight bytes for it


def test_report_names_the_model_and_its_shape(tmp_path: Path) -> None:
    old = report.markdown(recorded_run(), {})  # a results file from before --model
    assert "### sgl next to vLLM, llama-server and transformers: SmolLM2-135M-Instruct" in old
    assert "all on SmolLM2-135M-Instruct (the bundled GGUF dequantized" in old
    doc = recorded_run()
    doc["model"] = {"name": "llama-3.2-1b", "label": "llama-3.2-1b (random weights)",
                    "description": "random bfloat16 weights of meta-llama/Llama-3.2-1B's shape",
                    "shape": "LlamaForCausalLM, hidden 2048, 16 layers"}
    text = report.markdown(doc, {})
    assert text.startswith("<!-- compare:begin llama-3.2-1b (written by benchmarks/compare")
    assert text.rstrip().endswith("<!-- compare:end llama-3.2-1b -->")
    assert ": llama-3.2-1b (random weights)\n" in text
    assert "Shape: LlamaForCausalLM, hidden 2048, 16 layers." in text
    # its own block after smollm2's, which stays; its own charts
    doc_path = tmp_path / "benchmarks.md"
    doc_path.write_text("# Benchmarks\n\n" + old + "\n## After\n")
    report.update_docs(doc_path, text)
    report.update_docs(doc_path, text)
    written = doc_path.read_text()
    assert written.count(report.BEGIN) == 1 and written.count("compare:begin llama-3.2-1b") == 1
    assert written.index(report.END) < written.index("compare:begin llama") < written.index(
        "## After")
    charts = report.write_charts(doc, tmp_path / "img")
    assert sorted(p.name for p in charts.values()) == ["compare-llama-3.2-1b-throughput.png",
                                                      "compare-llama-3.2-1b-ttft.png"]


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
    (["--model", "llama-9b"], "argument --model: 'llama-9b' is neither smollm2, a ladder model"),
    (["--engines", "sgl-gguf"], "--engines: unknown engine 'sgl-gguf'; choose from sgl, "
                                "sgl-w8a8, sgl-gguf-q4_1,"),
    (["--model", "llama-3.2-1b", "--engines", "sgl,llama-server-q4_1"],
     "--engines: 'llama-server-q4_1' makes no sense for model llama-3.2-1b: it has no q4_1 GGUF "
     "(its kinds: bf16, q8_0, q4_k_m, q5_k_m, q6_k)"),
    (["--engines", "sgl-gguf-q3_k_s"], "'sgl-gguf-q3_k_s' makes no sense for model smollm2"),
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

    args = parse_args(["--engines", "sgl,sgl-gguf-q4_1,llama-server-q4_1", "--sgl-dtype", "auto"])
    peers = Peers(Path("/peers"), args.model)
    dense, gguf = (server_spec(name, args, peers, 30000) for name in ("sgl", "sgl-gguf-q4_1"))
    path = gguf.command[gguf.command.index("--model-path") + 1]
    assert path == str(bundled_model_path()) and gguf.name == "sgl-gguf-q4_1"
    assert "--quantization" not in gguf.command  # sgl's default: the file's blocks
    assert gguf.settings.startswith("Q4_1 GGUF weights, dtype auto,")
    assert gguf.label == "sgl, GGUF Q4_1"
    assert dense.command[dense.command.index("--model-path") + 1] == "/peers/models/smollm2/hf"
    args = parse_args(["--engines", "sgl,sgl-gguf-q4_1", "--sgl-int8-activations", "on"])
    dense, gguf = (server_spec(name, args, peers, 30000) for name in ("sgl", "sgl-gguf-q4_1"))
    at = gguf.command.index("--int8-activations")
    assert gguf.command[at + 1] == "on" and "--int8-activations" not in dense.command
    assert "int8 activations on" in gguf.settings


def test_sgl_w8a8_serves_the_folder_in_int8_and_reads_a_byte_per_linear_weight(
        tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from compare.__main__ import weight_bytes

    args = parse_args(["--engines", "sgl,sgl-w8a8"])
    spec = server_spec("sgl-w8a8", args, SimpleNamespace(hf_folder=tmp_path), 30000)
    assert spec.command[spec.command.index("--model-path") + 1] == str(tmp_path)
    assert spec.command[spec.command.index("--quantization") + 1] == "w8a8_int8"
    assert spec.label == "sgl, w8a8_int8" and "--quantization w8a8_int8" in spec.settings
    assert "--quantization" not in server_spec("sgl", args, SimpleNamespace(
        hf_folder=tmp_path), 30000).command
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16, dtype=torch.bfloat16),
               "model.embed_tokens.weight": torch.zeros(10, 8, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(8)}, str(tmp_path / "model.safetensors"))
    peers = SimpleNamespace(hf_folder=tmp_path)
    assert weight_bytes("sgl-w8a8", peers) == 8 * 16 + 10 * 8 * 2 + 8 * 4


def test_engines_follow_the_model(tmp_path: Path) -> None:
    from sgl.model_loader import bundled_model_path

    # smollm2: the set before --model, with sgl-gguf named after its kind
    assert parse_args([]).engines == ["sgl", "sgl-w8a8", "sgl-gguf-q4_1", "vllm",
                                      "llama-server-bf16", "llama-server-q8_0",
                                      "llama-server-q4_1", "transformers"]
    assert parse_args([]).results.name == "compare.json"
    args = parse_args(["--model", "qwen2.5-0.5b"])
    assert args.engines == ["sgl", "sgl-w8a8", "sgl-gguf-q8_0", "sgl-gguf-q4_k_m",
                            "sgl-gguf-q5_k_m", "sgl-gguf-q6_k", "vllm", "llama-server-bf16",
                            "llama-server-q8_0", "llama-server-q4_k_m", "llama-server-q5_k_m",
                            "llama-server-q6_k"]
    assert args.results.name == "compare-qwen2.5-0.5b.json"
    peers = Peers(tmp_path, args.model)
    assert peers.hf_folder == tmp_path / "models" / "qwen2.5-0.5b" / "hf"
    assert peers.gguf("q4_k_m") == tmp_path / "models" / "qwen2.5-0.5b" / "q4_k_m.gguf"
    llama = server_spec("llama-server-q6_k", args, SimpleNamespace(
        model=args.model, llama_server=Path("/bin/true"), gguf=peers.gguf), 30000)
    assert llama.command[llama.command.index("-m") + 1] == str(peers.gguf("q6_k"))
    assert llama.command[llama.command.index("--alias") + 1] == "qwen2.5-0.5b"
    # a GGUF file is served as it is; a Hugging Face folder is used as it is
    gguf = parse_args(["--model", str(bundled_model_path())]).model
    assert gguf.origin == "gguf" and gguf.kinds[0] == "q4_1"
    assert Peers(tmp_path, gguf).gguf("q4_1") == bundled_model_path()
    (tmp_path / "My-Model").mkdir()
    (tmp_path / "My-Model" / "config.json").write_text("{}")
    args = parse_args(["--model", str(tmp_path / "My-Model"), "--engines", "sgl,vllm"])
    assert args.model.slug == "my-model" and args.model.kinds == ("bf16", "q8_0", "q4_k_m",
                                                                  "q5_k_m", "q6_k")
    assert Peers(tmp_path, args.model).hf_folder == tmp_path / "My-Model"


class RecordingPeers:
    """A Peers that records what prepare() asks for and builds nothing."""

    def __init__(self, root: Path, model) -> None:
        self.real, self.calls = Peers(root, model), []
        self.llama_server = None

    def gguf(self, kind: str) -> Path:
        return self.real.gguf(kind)

    def __getattr__(self, name: str):
        if not name.startswith("ensure_"):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, *args))


def test_setup_builds_what_the_engines_need(tmp_path: Path) -> None:
    args = parse_args(["--model", "llama-3.2-1b", "--engines",
                       "sgl,sgl-gguf-q4_k_m,llama-server-q4_k_m,llama-server-bf16"])
    peers = RecordingPeers(tmp_path, args.model)
    assert prepare(args, peers) == {}
    assert peers.calls == [("ensure_hf_folder",), ("ensure_llama_server",),
                           ("ensure_gguf", "q4_k_m"), ("ensure_gguf", "bf16")]
    # smollm2's own Q4_1 file needs no llama.cpp for sgl; vLLM only when asked for
    args = parse_args(["--engines", "sgl-gguf-q4_1,vllm"])
    peers = RecordingPeers(tmp_path, args.model)
    prepare(args, peers)
    assert peers.calls == [("ensure_hf_folder",), ("ensure_vllm",), ("ensure_gguf", "q4_1")]


def test_smollm2_files_of_the_old_layout_are_adopted(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "smollm2-hf").mkdir(parents=True)
    (models / "smollm2-hf" / "config.json").write_text("{}")
    (models / "smollm2-q8_0.gguf").write_bytes(b"GGUF")
    (models / "smollm2-q4_1.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    peers = Peers(tmp_path, parse_args([]).model)
    assert peers.ensure_hf_folder() == models / "smollm2" / "hf"
    assert (models / "smollm2" / "hf" / "config.json").exists()
    assert peers.ensure_gguf("q8_0").read_bytes() == b"GGUF"
    assert not (models / "smollm2-hf").exists()


@pytest.mark.parametrize("name", list(LADDER))
def test_ladder_shapes_have_the_published_parameter_counts(name: str) -> None:
    """Non-embedding parameters (a rung's vocabulary is SmolLM2's 49152, not the source's)
    within 2% of the published model's, computed on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    rung = LADDER[name]
    config = ladder_config(name, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    assert type(config).__name__ == rung.config_class
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == rung.architecture
    ours = sum(p.numel() for n, p in model.named_parameters()
               if "embed_tokens" not in n and "lm_head" not in n)
    embeddings = rung.published_vocab * config.hidden_size * (
        1 if config.tie_word_embeddings else 2)
    assert ours == pytest.approx(rung.published_params - embeddings, rel=0.02)


TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.1-8b", "qwen2-moe-a2.7b"])
def test_sharded_folder_loads_back_in_transformers(name: str, tmp_path: Path,
                                                   monkeypatch) -> None:
    """A tiny model of the rung's family, written in several shards: transformers loads it
    with no key missing or unexpected, and saves back the very tensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(hf_folder, "SHARD_BYTES", 20_000)
    shape = {k: v for k, v in TINY.items()
             if "expert" not in k or LADDER[name].config_class == "Qwen2MoeConfig"}
    folder = hf_folder.folder_from_ladder(name, tmp_path / "hf", **shape)
    assert not (tmp_path / "hf.partial").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    written = {k: v for p in shards for k, v in load_file(p).items()}
    assert written.keys() == index["weight_map"].keys()
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == [LADDER[name].architecture]
    assert raw["torch_dtype"] == "bfloat16" and raw["rope_theta"] == LADDER[name].shape[
        "rope_theta"]
    assert AutoConfig.from_pretrained(folder).vocab_size == 49152
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model.save_pretrained(tmp_path / "again")
    again = {k: v for p in (tmp_path / "again").glob("*.safetensors")
             for k, v in load_file(p).items()}
    assert again.keys() == written.keys()
    assert all(torch.equal(again[k], written[k]) for k in written)
    assert (folder / "generation_config.json").exists()
    # SmolLM's pre-tokenizer (llama.cpp's converter knows the tokenizer by it): digits one by one
    assert AutoTokenizer.from_pretrained(folder).tokenize(" 2024") == ["Ġ", "2", "0", "2", "4"]


def test_ladder_folder_is_served_by_sgl(tmp_path: Path) -> None:
    """The MoE rung's checkpoint layout (experts one by one, a shared expert) in sgl.Engine."""
    import sgl

    folder = hf_folder.folder_from_ladder("qwen2-moe-a2.7b", tmp_path / "hf", **TINY)
    engine = sgl.Engine(model_path=str(folder), dtype="float32", max_total_tokens=512,
                        context_length=128, log_level="warning")
    try:
        out = engine.generate("Hello", {"max_new_tokens": 4, "temperature": 0})
    finally:
        engine.shutdown()
    assert out["meta_info"]["completion_tokens"] == 4
    shape = resolve_model("qwen2-moe-a2.7b").describe(folder)["shape"]
    assert shape.startswith("Qwen2MoeForCausalLM, hidden 64, 2 layers, 4 heads (2 KV), 4 experts "
                            "of 32 (2 per token), shared expert 96, vocabulary 49152 (untied")


@pytest.mark.slow
def test_model_folder_loads_in_transformers(tmp_path: Path) -> None:
    """The folder vLLM and transformers read: the bundled GGUF's tensors in bfloat16 under
    Hugging Face names, a config with architectures, the tokenizer; written once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sgl.model_loader import iter_weights

    peers = Peers(tmp_path, parse_args([]).model)
    folder = peers.ensure_hf_folder()
    index = folder / "model.safetensors.index.json"
    stamp = index.stat().st_mtime_ns
    assert peers.ensure_hf_folder() == folder
    assert index.stat().st_mtime_ns == stamp
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
