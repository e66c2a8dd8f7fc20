"""SGLang's own clients against a real sgl server (issue 18): its frontend language through its
``RuntimeEndpoint`` gives what sgl's frontend gives for the same programs, and its
``bench_serving`` module runs a command line from SGLang's docs.

The ``sglang`` wheel is installed with ``--no-deps`` into a folder of its own (with the three
small packages its frontend imports), and run by this Python through ``PYTHONPATH``, so torch
stays this environment's CPU build and nothing of SGLang's leaks into sgl's environment.
SGLANG_VERSION is the newest release whose ``bench_serving`` imports without SGLang's whole
runtime: from 0.5 on it imports the server's model configs, and through them torchvision, whose
wheels do not load on a CPU build of torch. Its frontend language is the current one's (0.5.23
gives the same results for lang_programs.py, checked by hand when this was written).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_testing import ServerProcess

pytestmark = pytest.mark.slow

SGLANG_VERSION = "0.4.10.post2"
#: what its frontend and bench_serving import that this environment does not have
SGLANG_IMPORTS = ["pybase64==1.5.1", "ipython==9.18.1", "traitlets==5.16.1"]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sglang_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process that can ``import sglang`` (SGLang's own package)."""
    site = tmp_path_factory.mktemp("sglang-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--target", str(site),
                    f"sglang=={SGLANG_VERSION}", *SGLANG_IMPORTS],
                   check=True, capture_output=True, timeout=900)
    # offline: bench_serving looks the model name up on the hub, which is out of reach here
    return {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}


def run_programs(frontend: str, server: ServerProcess, env: dict[str, str] | None) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "lang_programs.py"), frontend,
                          server.base_url], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sglang_frontend_language_matches_sgls(server: ServerProcess,
                                               sglang_env: dict[str, str]) -> None:
    """gen with stop and regex, select (its normalized logprobs too), fork, run_batch and
    logprobs through SGLang's RuntimeEndpoint: the results sgl's frontend gets, to the token."""
    probe = subprocess.run([sys.executable, "-c", "import sglang; print(sglang.__version__)"],
                           capture_output=True, text=True, env=sglang_env, timeout=120)
    assert probe.stdout.strip() == SGLANG_VERSION, probe.stderr[-2000:]
    theirs = run_programs("sglang", server, sglang_env)
    ours = run_programs("sgl", server, None)
    assert theirs == ours
    assert theirs["facts"]["large"] in ("yes", "no") and theirs["facts"]["number"].isdigit()
    assert len(theirs["select_scores"]) == 2
    # SGLang's client reads output_token_logprobs_length; it counts the output tokens
    assert theirs["story_logprobs_length"] == theirs["story_completion_tokens"] == 6
    assert len(theirs["story_logprob_tokens"]) == 6


@pytest.mark.parametrize("backend,dataset", [
    ("sglang", ["--dataset-name", "random-ids", "--random-input-len", "16",
                "--random-output-len", "4", "--random-range-ratio", "1"]),
    ("sglang-oai-chat", ["--dataset-name", "random-ids", "--random-input-len", "16",
                         "--random-output-len", "4", "--random-range-ratio", "1"]),
    ("sglang", ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
                "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "32",
                "--gsp-question-len", "8", "--gsp-output-len", "4"]),
])
def test_sglang_bench_serving_against_sgl(server: ServerProcess, sglang_env: dict[str, str],
                                          tmp_path: Path, backend: str,
                                          dataset: list[str]) -> None:
    """``python -m sglang.bench_serving`` as SGLang's docs run it, against sgl: every request
    succeeds with the asked-for output length. Its tokenizer is the served model's, saved as a
    Hugging Face folder (bench_serving does not read GGUF)."""
    from sgl.model_loader import load_tokenizer

    tokenizer = tmp_path / "tokenizer"
    load_tokenizer(None).save_pretrained(tokenizer)
    results = tmp_path / "results.jsonl"
    host, port = server.base_url.removeprefix("http://").split(":")
    out = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--backend", backend,
                          "--host", host, "--port", port, "--num-prompts", "4", *dataset,
                          "--tokenizer", str(tokenizer), "--output-file", str(results),
                          "--disable-tqdm"], capture_output=True, text=True, timeout=600,
                         env=sglang_env, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    line = json.loads(results.read_text().splitlines()[-1])
    assert line["completed"] == 4 and line["total_output_tokens"] == 16, line
    assert line["mean_ttft_ms"] > 0 and line["mean_e2e_latency_ms"] >= line["mean_ttft_ms"]
