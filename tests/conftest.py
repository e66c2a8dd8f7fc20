"""Shared fixtures: one real server for the whole session, started with a route plugin loaded
from a temporary file (``--plugin path.py``), so the end-to-end tests and the plugin tests talk
to the same process."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_testing import ServerProcess

# Servers and CLI runs started by the tests record the decode forwards of batch sizes 1-8 before
# serving, not the default 1-64 (seconds of start-up each; larger sizes are still recorded when
# they recur). The shared session server below keeps the default, and tests/plugins/kernels/test_cpu_graph.py
# tests it.
os.environ.setdefault("SGL_CPU_GRAPH_MAX_BS", "8")

ROUTE_PLUGIN = textwrap.dedent('''
    """A plugin in a single file: one route, and start-up notes written to a file."""
    import os

    from fastapi import APIRouter

    from sgl import hookimpl


    def make_router(server):
        router = APIRouter()

        @router.get("/from-file-plugin")
        async def from_file_plugin():
            return {"plugin": "file", "model": server.model_name}

        return router


    @hookimpl
    def sgl_register_frontends(register):
        register("file-route", make_router)


    @hookimpl
    def sgl_on_startup(settings, process, context):
        with open(os.environ["SGL_TEST_MARKERS"], "a") as f:
            f.write(f"startup {process}\\n")


    @hookimpl
    def sgl_on_shutdown(settings, process):
        with open(os.environ["SGL_TEST_MARKERS"], "a") as f:
            f.write(f"shutdown {process}\\n")
''')


@pytest.fixture(scope="session")
def route_plugin_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plugin") / "file_route_plugin.py"
    path.write_text(ROUTE_PLUGIN)
    return path


@pytest.fixture(scope="session")
def markers_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("markers") / "markers.txt"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, route_plugin_file: Path,
           markers_file: Path) -> Iterator[ServerProcess]:
    """The bundled SmolLM2 behind a real `sgl serve` on a free loopback port, in float32 (the
    dtype of the transformers reference its outputs are checked against; ``auto`` would be
    bfloat16 on a CPU with AMX)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess("--plugin", str(route_plugin_file), "--max-total-tokens", "16384",
                         "--dtype", "float32",
                         env={"SGL_TEST_MARKERS": str(markers_file),
                              "SGL_CPU_GRAPH_MAX_BS": ""},  # the default
                         log_path=log)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers' own model of the bundled SmolLM2 GGUF (float32), converted by transformers'
    GGUF loader: the reference that sgl's outputs and logprobs are checked against."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sgl.model_loader import bundled_model_path, load_hf_config

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_config(load_hf_config(path), torch_dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    model.load_state_dict(state["tensors"], strict=False)
    model.tie_weights()
    return model.eval()
