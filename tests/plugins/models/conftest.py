"""The family tests run torch on one thread, as the scheduler does on a 2-core machine, so that
they go through sgl's CPU kernels and replay recorded decode forwards (sgl.engine.cpu_graph)
where the model allows it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
