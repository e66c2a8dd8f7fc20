"""`sgl bench` end to end: the plugin is installed, `serving` runs against the session's real
server (every backend), `one-batch` runs tiny batches, and the results files keep their schema.
No timing assertions: only that the numbers exist and add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sgl_testing import ServerProcess, free_port

pytestmark = pytest.mark.slow

STATS = {"mean", "median", "p99", "std", "max"}
COMMON = {"schema", "command", "date", "config", "environment", "metrics"}


def sgl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sgl", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_plugin_is_installed() -> None:
    out = sgl("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["tool-bench"]["available"]
    assert rows["tool-bench"]["hooks"] == ["sgl_register_commands"]
    help_text = sgl("bench", "--help").stdout
    for command in ("serving", "offline", "one-batch"):
        assert command in help_text


def test_engine_settings_follow_sgl_serve() -> None:
    text = sgl("bench", "offline", "--help").stdout
    for flag in ("--dtype", "--num-threads", "--disable-radix-cache", "--max-total-tokens",
                 "--chunked-prefill-size", "--schedule-policy"):
        assert flag in text
    assert "--port" not in text and "--api-key" not in text  # server-only settings left out
    assert "schema" in text and "sgl-bench/1" in text  # the results file is documented


def _serving(server: ServerProcess, tmp_path: Path, backend: str, *extra: str) -> dict[str, Any]:
    out_file = tmp_path / f"{backend}.json"
    out = sgl("bench", "serving", "--base-url", server.base_url, "--backend", backend,
              "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
              "--max-concurrency", "2", "--output-file", str(out_file), "--output-details",
              *extra)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Serving benchmark" in out.stdout and "Time to first token" in out.stdout
    assert "Traceback" not in out.stderr
    return json.loads(out_file.read_text())


def _check_serving_doc(doc: dict[str, Any], backend: str, n: int, out_len: int,
                       rate: Any = "inf") -> None:
    assert COMMON <= set(doc) and doc["schema"] == "sgl-bench/1"
    assert doc["command"] == "serving"
    assert doc["config"]["backend"] == backend and doc["config"]["request_rate"] == rate
    assert doc["server"]["backend"] == backend
    m = doc["metrics"]
    assert (m["completed"], m["failed"]) == (n, 0)
    assert m["total_output_tokens"] == n * out_len  # ignore_eos: exactly the requested length
    assert m["duration_s"] > 0
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])
    assert m["request_throughput"] == pytest.approx(n / m["duration_s"])
    assert 0 < m["concurrency"] <= 2.0 + 1e-6  # --max-concurrency 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert set(m[key]) == STATS and m[key]["mean"] > 0
    assert m["ttft_ms"]["mean"] < m["e2e_latency_ms"]["mean"]
    reqs = doc["requests"]
    assert len(reqs) == n
    for r in reqs:
        assert r["success"] and r["error"] is None and r["output_len"] == out_len
        assert len(r["itl_ms"]) == out_len - 1  # one chunk per token from sgl
        # the last chunk (TTFT + the gaps after it) arrives before the response ends
        assert r["ttft_ms"] + sum(r["itl_ms"]) <= r["e2e_latency_ms"] + 1e-6
    assert m["total_input_tokens"] == sum(r["prompt_len"] for r in reqs)


def test_serving_native(server: ServerProcess, tmp_path: Path) -> None:
    doc = _serving(server, tmp_path, "sgl", "--flush-cache")
    _check_serving_doc(doc, "sgl", n=4, out_len=4)
    assert doc["metrics"]["total_input_tokens"] == 4 * 16  # token ids: exact lengths


def test_serving_openai_backends(server: ServerProcess, tmp_path: Path) -> None:
    chat = _serving(server, tmp_path, "openai-chat")
    _check_serving_doc(chat, "openai-chat", n=4, out_len=4)
    assert chat["server"]["model"] == "SmolLM2-135M-Instruct.Q4_1"  # from GET /v1/models
    # the server's count, chat template included, replaces the prompt's own
    assert chat["metrics"]["total_input_tokens"] > 4 * 16
    completions = _serving(server, tmp_path, "openai-completions",
                           "--request-rate", "50", "--dataset", "generated-shared-prefix",
                           "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
                           "--gsp-system-prompt-len", "12", "--gsp-question-len", "4",
                           "--gsp-output-len", "4")
    _check_serving_doc(completions, "openai-completions", n=4, out_len=4, rate=50.0)


def test_serving_takes_sglang_bench_serving_flags(server: ServerProcess, tmp_path: Path) -> None:
    """A command line in SGLang's bench_serving spelling: --host/--port, --dataset-name, its
    backend names, --extra-request-body merged into every request, --disable-stream, and a
    .jsonl results file that each run appends one line with bench_serving's keys to."""
    port = server.base_url.rsplit(":", 1)[1]
    common = ["--host", "127.0.0.1", "--port", port, "--dataset-name", "random",
              "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
              "--random-range-ratio", "1.0", "--max-concurrency", "2", "--disable-tqdm"]
    results = tmp_path / "results.jsonl"
    out = sgl("bench", "serving", "--backend", "sglang", *common, "--output-file", str(results))
    assert out.returncode == 0, out.stdout + out.stderr
    out = sgl("bench", "serving", "--backend", "sglang-oai", *common, "--output-file",
              str(results), "--extra-request-body", '{"max_tokens": 2}', "--disable-stream")
    assert out.returncode == 0, out.stdout + out.stderr
    native, oai = (json.loads(line) for line in results.read_text().splitlines())
    assert native["server"] == {**native["server"], "backend": "sgl",
                                "base_url": server.base_url}
    assert (native["backend"], native["dataset_name"], native["completed"]) == ("sgl", "random", 4)
    assert native["total_output_tokens"] == 16 and native["mean_itl_ms"] > 0
    assert native["mean_ttft_ms"] == native["metrics"]["ttft_ms"]["mean"]
    assert oai["backend"] == "openai-completions"
    assert oai["total_output_tokens"] == 4 * 2  # the extra body's max_tokens won
    # not streamed: the whole response is the first token, and there is no ITL
    assert oai["mean_itl_ms"] is None
    assert oai["mean_ttft_ms"] == pytest.approx(oai["mean_e2e_latency_ms"], rel=0.05)
    # the example at the top of bench_serving.py, scaled down (its --random-input and
    # --random-output are argparse's abbreviations of the -len options)
    docs = tmp_path / "docs.json"
    out = sgl("bench", "serving", "--backend", "sglang", "--dataset-name", "random",
              "--num-prompts", "6", "--random-input", "32", "--random-output", "8",
              "--random-range-ratio", "0.5", "--port", port, "--output-file", str(docs))
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(docs.read_text())
    assert doc["completed"] == 6 and 6 * 4 <= doc["total_output_tokens"] <= 6 * 8
    for bad, message in ((["--extra-request-body", "{"], "--extra-request-body"),
                         (["--extra-request-body", "[1]"], "expected a JSON object"),
                         (["--base-url", server.base_url], "not both")):
        out = sgl("bench", "serving", *common, *bad)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_unreachable_server_is_a_clear_error() -> None:
    out = sgl("bench", "serving", "--base-url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 1
    assert "Error: cannot reach the server at http://127.0.0.1:" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_sharegpt_file_is_a_clear_error(server: ServerProcess, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{\"not\": \"a list\"}")
    out = sgl("bench", "serving", "--base-url", server.base_url, "--dataset", "sharegpt",
              "--dataset-path", str(bad))
    assert out.returncode == 1
    assert "must hold a JSON list of conversations" in out.stderr
    assert "Traceback" not in out.stderr
    out = sgl("bench", "serving", "--base-url", server.base_url, "--dataset", "sharegpt")
    assert out.returncode == 1 and "needs --dataset-path" in out.stderr


def test_one_batch(tmp_path: Path) -> None:
    out_file = tmp_path / "one.json"
    out = sgl("bench", "one-batch", "--batch-size", "1", "--batch-size", "2", "--input-len", "8",
              "--output-len", "3", "--num-threads", "1", "--output-file", str(out_file))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| batch | input | output |" in out.stdout
    doc = json.loads(out_file.read_text())
    assert COMMON <= set(doc) and doc["command"] == "one-batch"
    assert doc["config"]["engine"] == {"num_threads": 1}
    assert [(c["batch_size"], c["input_len"], c["output_len"]) for c in doc["metrics"]] == \
        [(1, 8, 3), (2, 8, 3)]
    for case in doc["metrics"]:
        assert len(case["decode_latencies_s"]) == 2  # output_len - 1 decode steps
        assert case["prefill_latency_s"] > 0 and case["median_decode_latency_s"] > 0
        assert case["total_latency_s"] == pytest.approx(
            case["prefill_latency_s"] + sum(case["decode_latencies_s"]))
        assert case["median_decode_throughput"] == pytest.approx(
            case["batch_size"] / case["median_decode_latency_s"])


def test_one_batch_bad_setting_is_a_clear_error() -> None:
    out = sgl("bench", "one-batch", "--model-path", "/nonexistent/model", "--input-len", "4")
    assert out.returncode == 1
    assert "cannot load the model runner" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    out = sgl("bench", "one-batch", "--quantization", "int8", "--input-len", "4")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "--quantization int8 rounds a Hugging Face checkpoint's weights" in out.stderr


def test_one_batch_says_how_the_weights_are_held() -> None:
    out = sgl("bench", "one-batch", "--input-len", "8", "--output-len", "2",
              "--quantization", "none", "--dtype", "float32")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "float32, quantization none, weights" in out.stdout
    out = sgl("bench", "one-batch", "--input-len", "8", "--output-len", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "quantization gguf, weights" in out.stdout


def test_offline(tmp_path: Path) -> None:
    out_file = tmp_path / "offline.json"
    out = sgl("bench", "offline", "--num-prompts", "3", "--random-input-len", "12",
              "--random-output-len", "3", "--num-threads", "1", "--disable-radix-cache",
              "--max-total-tokens", "2048", "--output-file", str(out_file))
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out_file.read_text())
    assert COMMON <= set(doc) and doc["command"] == "offline"
    assert doc["config"]["engine"] == {"num_threads": 1, "disable_radix_cache": True,
                                       "max_total_tokens": 2048, "log_level": "warning"}
    m = doc["metrics"]
    assert (m["completed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 36, 9)
    assert m["cached_tokens"] == 0  # radix cache off
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])
