"""The metadata of sgl's distributions (the core, every plugin, the example plugin) agrees with
the code: a Python that ``requires-python`` admits can import what the code imports."""

from __future__ import annotations

import ast
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = sorted(p for p in ROOT.glob("**/pyproject.toml")
                    if not {".venv", "build", "node_modules"} & set(p.relative_to(ROOT).parts))

#: standard-library modules that appeared after Python 3.8, and the release that added them
NEW_STDLIB = {"graphlib": (3, 9), "zoneinfo": (3, 9), "tomllib": (3, 11)}


@cache
def imported_stdlib(folder: Path) -> dict[str, Path]:
    """The NEW_STDLIB modules that the Python files below ``folder`` import, with one file each."""
    found: dict[str, Path] = {}
    for path in folder.glob("**/*.py"):
        if {"build", ".venv"} & set(path.relative_to(folder).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.split(".")[0] in NEW_STDLIB:
                    found.setdefault(name.split(".")[0], path)
    return found


def test_every_distribution_is_found() -> None:
    assert len(PYPROJECTS) >= 18, PYPROJECTS  # the core, 16 plugins, the example plugin


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_requires_python_admits_no_python_that_cannot_import_the_code(pyproject: Path) -> None:
    """It said ``>=3.10`` everywhere while ``sgl.config`` imports ``tomllib`` (3.11)."""
    spec = SpecifierSet(tomllib.loads(pyproject.read_text())["project"]["requires-python"])
    # every distribution imports the core, so the core's imports count for all of them
    modules = {**imported_stdlib(ROOT / "core"), **imported_stdlib(pyproject.parent)}
    for module, path in modules.items():
        major, minor = NEW_STDLIB[module]
        too_old = [f"3.{m}" for m in range(8, minor) if f"3.{m}.0" in spec]
        assert not too_old, (f"{pyproject.relative_to(ROOT)} admits Python {too_old}, but "
                             f"{path.relative_to(ROOT)} imports {module} ({major}.{minor}+)")
    assert f"{sys.version_info.major}.{sys.version_info.minor}.0" in spec
