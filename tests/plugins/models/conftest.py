"""The family tests run torch on one thread, as the scheduler does on a 2-core machine, so that
they go through sgl's CPU kernels and replay recorded decode forwards (sgl_kernels_cpu.graphs)
where the model allows it."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _on_one_torch_thread(one_torch_thread: None) -> None:
    """Every test here uses ``one_torch_thread`` (from sgl_testing)."""
