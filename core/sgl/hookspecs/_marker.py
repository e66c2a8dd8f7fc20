"""The pluggy markers of the ``sgl`` project."""

from __future__ import annotations

import pluggy

PROJECT_NAME = "sgl"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
