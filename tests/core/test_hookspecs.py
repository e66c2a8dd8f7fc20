"""Meta-tests: every hook is documented (docstring and docs/hooks.md) and tested."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from sgl.hookspecs import SPEC_MODULES

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [
    (name, fn)
    for module in SPEC_MODULES
    for name, fn in inspect.getmembers(module, inspect.isfunction)
    if name.startswith("sgl_")
]


def signature(fn) -> str:
    return f"{fn.__name__}({', '.join(inspect.signature(fn).parameters)})"


def test_there_are_hooks_for_every_concern() -> None:
    names = {name for name, _ in HOOKS}
    for needed in ("sgl_register_attention_backends", "sgl_register_model_archs",
                   "sgl_register_grammar_backends", "sgl_register_cache_policies",
                   "sgl_register_speculative_algorithms", "sgl_register_parallel_strategies",
                   "sgl_register_kv_transfer_backends", "sgl_register_frontends",
                   "sgl_register_commands", "sgl_add_config", "sgl_on_startup",
                   "sgl_on_shutdown"):
        assert needed in names


@pytest.mark.parametrize("name,fn", HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_docstring_is_complete(name: str, fn) -> None:
    doc = inspect.getdoc(fn) or ""
    for param in inspect.signature(fn).parameters:
        assert f":param {param}:" in doc, f"{name}: no :param {param}:"
    assert ":return:" in doc and "Runs in:" in doc and "versionadded" in doc, name


@pytest.mark.parametrize("name,fn", HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_is_documented_with_its_signature(name: str, fn) -> None:
    docs = (ROOT / "docs" / "hooks.md").read_text()
    heading = f"### `{signature(fn)}`"
    assert heading in docs, f"docs/hooks.md lacks the section {heading}"
    section = docs.split(heading, 1)[1].split("\n### ", 1)[0]
    assert "```python" in section and "@hookimpl" in section, f"{name}: no example in docs"


@pytest.mark.parametrize("name,fn", HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_has_a_test(name: str, fn) -> None:
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    assert re.search(rf"def test_hook_{name}\b", sources), f"no test_hook_{name} in tests/"


@pytest.mark.parametrize("name,fn", HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_has_a_row_in_the_architecture(name: str, fn) -> None:
    """docs/architecture.md's table of plugin kinds names every hook: a hook added without a
    row there (as the kernel libraries' and the API names' once were) is a page that drifted."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page.split("## Plugin kinds", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert any(f"`{name}`" in row for row in rows), f"no row names `{name}`"


def test_hooks_md_counts_the_registries() -> None:
    """The number of registries hooks.md's process table gives is the number of
    ``sgl_register_*`` hooks that fill a registry (every one but the commands')."""
    registries = [n for n, _ in HOOKS if n.startswith("sgl_register_") and
                  n != "sgl_register_commands"]
    words = {9: "nine", 10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen", 14: "fourteen"}
    page = (ROOT / "docs" / "hooks.md").read_text()
    assert f"(all {words[len(registries)]} registries)" in page, len(registries)
