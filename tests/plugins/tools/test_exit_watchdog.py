"""sgl_testing's exit watchdog: a run whose tests leave a thread running ends with the stacks
printed and status 1, instead of holding the interpreter until CI's time limit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

LEAKY_TEST = textwrap.dedent('''
    import threading

    def test_leaves_a_thread_behind():
        threading.Thread(target=threading.Event().wait, name="left-behind").start()
''')

CLEAN_TEST = "def test_nothing_left():\n    assert True\n"


def _run_pytest(tmp_path: Path, source: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "test_case.py").write_text(source)
    env = {**os.environ, "SGL_TEST_EXIT_GRACE_S": "3"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_case.py")],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    return done, time.monotonic() - start


def test_a_thread_left_running_fails_the_run_with_its_stack(tmp_path: Path) -> None:
    done, _ = _run_pytest(tmp_path, LEAKY_TEST)
    assert "1 passed" in done.stdout
    assert done.returncode == 1
    assert "Thread" in done.stderr and "wait" in done.stderr, done.stderr[-2000:]


def test_a_clean_run_exits_at_once_with_its_status(tmp_path: Path) -> None:
    done, seconds = _run_pytest(tmp_path, CLEAN_TEST)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert seconds < 60
