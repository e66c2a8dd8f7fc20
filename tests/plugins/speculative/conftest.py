"""Fixtures the speculative-decoding tests share."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "core"))
from test_scheduler import Harness  # noqa: E402


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """The bundled SmolLM2 in a real scheduler without speculation (float32): the outputs the
    speculative runs must equal."""
    h = Harness(tmp_path_factory.mktemp("smollm2"))
    with torch.inference_mode():
        yield h
    h.close()
