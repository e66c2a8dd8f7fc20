"""The core holds no feature: no module under core/sgl names a model family, a checkpoint
format or an x86 instruction-set level in its code (its contracts' docstrings and comments may,
as examples). The families' GGUF rules, the checkpoint formats, the kernel levels, the CPU
replays and prefill/decode disaggregation are plugins'; a name that creeps back into the core
fails here with its file and line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core" / "sgl"
#: feature names; ``llama.cpp`` (the project), ``llama-server`` and the rope type ``llama3``
#: (transformers' name for a rope scaling several families use) are not families
FEATURE = re.compile(r"llama(?!\.cpp|-server|_cpp|3)|qwen|gemma|\bphi(?:\d|\b)|mistral|gptq|"
                     r"\bawq|compressed[-_]tensors|\bamx\b|avx512|avx2", re.IGNORECASE)


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def feature_names(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each name or string in ``source``'s code (docstrings and comments
    left out) that names a feature."""
    tree = ast.parse(source)
    docs = _docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = None if id(node) in docs else node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = node.name
        elif isinstance(node, ast.arg):
            text = node.arg
        else:
            continue
        if text and FEATURE.search(text):
            found.append((node.lineno, text[:100]))
    return found


def test_no_core_module_names_a_feature() -> None:
    found = [f"{path.relative_to(CORE.parent)}:{line}: {text!r}"
             for path in sorted(CORE.rglob("*.py"))
             for line, text in feature_names(path.read_text())]
    assert not found, "the core names features in its code:\n" + "\n".join(found)


def test_the_features_that_moved_out_are_gone() -> None:
    assert not (CORE / "engine" / "disaggregation").exists()
    for name in ("cpu_graph.py", "gptq_awq.py", "compressed_tensors.py", "packed.py"):
        assert not list(CORE.rglob(name)), name


def test_the_check_can_fail() -> None:
    """What the check catches: a family's table, a format's name, a level in a condition;
    what it leaves: docstrings, the rope type, llama.cpp."""
    caught = feature_names('GEMMA = {"gemma2": 46}\nif m == "gptq": pass\nx = lv in ("amx",)\n')
    assert [line for line, _ in caught] == [1, 1, 2, 3]
    assert not feature_names('"""Gemma 2 soft-caps."""\nROPE = "llama3"  # Llama 3.1\n'
                             'NOTE = "as llama.cpp does"\n')
