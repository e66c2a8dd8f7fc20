"""The tutorial's example plugin (docs/plugins/sgl-hello), installed with pip into a separate
folder, is discovered through its entry point, listed by `sgl plugins`, and used by a server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sgl_testing import CAPITAL_QUESTION, ServerProcess, run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hello_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), str(ROOT / "docs" / "plugins" / "sgl-hello")], check=True)
    return target


@pytest.fixture(scope="module")
def hello_env(hello_site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    markers = tmp_path_factory.mktemp("hello-markers") / "markers.txt"
    path = os.pathsep.join([str(hello_site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "SGL_TEST_MARKERS": str(markers)}


@pytest.fixture(scope="module")
def hello_server(hello_env: dict[str, str], route_plugin_file: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("hello-server") / "server.log"
    proc = ServerProcess("--attention-backend", "toy", "--hello-greeting", "Bonjour",
                         "--plugin", str(route_plugin_file), "--max-total-tokens", "4096",
                         env=hello_env, log_path=log)
    yield proc
    proc.stop()


def test_example_plugin_is_discovered_and_listed(hello_env: dict[str, str]) -> None:
    result = run_cli(["plugins", "--json"], env=hello_env)
    assert result.returncode == 0, result.stderr
    hello = {p["name"]: p for p in json.loads(result.stdout)}["hello"]
    assert hello["distribution"] == "sgl-hello" and hello["source"] == "entry point"
    assert hello["hooks"] == ["sgl_add_config", "sgl_register_attention_backends",
                              "sgl_register_frontends"]
    help_text = run_cli(["serve", "--help"], env=hello_env).stdout
    assert "Options of plugin hello:" in help_text and "--hello-greeting" in help_text
    assert "toy" in help_text  # a choice of --attention-backend


def test_example_plugin_is_used(hello_server: ServerProcess) -> None:
    hello = httpx.get(f"{hello_server.base_url}/hello").json()
    assert hello == {"message": "Bonjour from SmolLM2-135M-Instruct.Q4_1",
                     "attention_backend": "toy"}
    response = httpx.post(f"{hello_server.base_url}/v1/chat/completions", timeout=120, json={
        "model": "default", "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user",
                      "content": CAPITAL_QUESTION}]})
    assert response.status_code == 200
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    assert "toy attention backend: first batch" in hello_server.log()


def test_hook_sgl_on_shutdown(hello_server: ServerProcess, hello_env: dict[str, str]) -> None:
    assert hello_server.stop() == 0
    lines = Path(hello_env["SGL_TEST_MARKERS"]).read_text().splitlines()
    assert {"startup server", "startup scheduler", "shutdown server", "shutdown scheduler"} \
        <= set(lines)
