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
