"""No import races at start-up: what the scheduler's first forwards import lazily is imported
before its first thread starts (the tokenizer's loader, a grammar backend's compiler threads).

The race this guards against failed one server start in three with ``--grammar-backend
llguidance``: ``ImportError: cannot import name 'IndentedBuffer' from 'torch._inductor.utils'``,
raised from ``torch._compile``, which the first call of some ``torch.ops.sgl`` operators
imports during decode-graph recording, while a grammar thread imported torch modules too. A
race shows only now and then, so the test checks its precondition, which holds or not every
time: in a fresh process (the suite's may have imported everything already), each Python
thread the scheduler starts finds the lazily imported modules already there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent

# the modules a forward imports on first use (torch.ops.sgl -> torch._compile -> torch._dynamo)
LAZY = ("torch._dynamo", "torch._inductor.utils")

PROBE = textwrap.dedent("""
    import json, sys, tempfile, threading, pathlib
    import torch
    sys.path.insert(0, {here!r})
    from test_scheduler import Harness, one

    lazy = {lazy!r}
    starts = []
    original = threading.Thread.start

    def start(self):
        starts.append([self.name, [m for m in lazy if m not in sys.modules]])
        return original(self)

    threading.Thread.start = start
    h = Harness(pathlib.Path(tempfile.mkdtemp()), grammar_backend={backend!r})
    try:
        schema = json.dumps({{"type": "object", "properties": {{"a": {{"type": "integer"}}}}}})
        with torch.inference_mode():  # as the scheduler process runs
            out = one(h, h.chat_ids("Give me a JSON object."), max_new_tokens=8,
                      temperature=0, json_schema=schema)
        assert out.error is None, out.error
    finally:
        h.close()
    print("STARTS " + json.dumps(starts))
""")


@pytest.mark.parametrize("backend", ["xgrammar", "outlines", "llguidance"])
def test_lazy_imports_happen_before_any_thread(backend: str, tmp_path: Path) -> None:
    code = PROBE.format(here=str(HERE), lazy=LAZY, backend=backend)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("STARTS "))
    starts = json.loads(line.removeprefix("STARTS "))
    assert starts, "the scheduler started no Python thread: the probe watches nothing"
    late = [(name, missing) for name, missing in starts if missing]
    assert not late, f"threads started before these modules were imported: {late}"
