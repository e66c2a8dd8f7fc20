"""docs/lang.md's examples (docs/examples/lang_*.py): shown unchanged in the page, and each runs
against the real session server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_testing import ServerProcess

DOCS = Path(__file__).resolve().parents[3] / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("lang_*.py"))

#: what each example must print (a check that it did its work, not only exit 0)
EXPECTED = {
    "lang_quickstart.py": [r"answer: +Paris", r"system: You are a helpful assistant\.",
                           r"user: What color is it\?", r"number: 5 int"],
    "lang_select_fork.py": [r"sentiment: +positive", r"scores: \[-[0-9.]+, -[0-9.]+\]",
                            r"Summary: Always", r"Sentiment \(positive or negative\): "
                                                r"(positive|negative)"],
    "lang_run_batch.py": [r"traced prefix: .*Q: What is '", r"A: 2 \| cached tokens: [1-9]",
                          r"A: 4 \| cached tokens: [1-9]"],
}


def test_every_example_is_in_the_page() -> None:
    page = (DOCS / "lang.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert {p.name for p in EXAMPLES} == set(EXPECTED)
    for path in EXAMPLES:
        assert path.read_text() in blocks, f"{path.name} differs from its copy in docs/lang.md"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path, server: ServerProcess) -> None:
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         env={**os.environ, "SGL_URL": server.base_url}, timeout=300)
    assert out.returncode == 0, out.stderr
    for pattern in EXPECTED[path.name]:
        assert re.search(pattern, out.stdout), (pattern, out.stdout)
