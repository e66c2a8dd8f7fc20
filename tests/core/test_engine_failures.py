"""``sgl.Engine`` when things go wrong, with a stand-in scheduler process and a toy tokenizer
(no model): a dying scheduler fails pending and new calls instead of hanging, and an engine left
running at interpreter exit is shut down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _fake_scheduler import start_fake_scheduler
from _toy_tokenizers import byte_level_bpe

import sgl
import sgl.engine.launch
import sgl.model_loader
from sgl.server.io_struct import GenerateError

HERE = Path(__file__).resolve().parent


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[sgl.Engine]:
    monkeypatch.setattr(sgl.engine.launch, "start_scheduler", start_fake_scheduler)
    monkeypatch.setattr(sgl.model_loader, "load_tokenizer", lambda path: byte_level_bpe())
    engine = sgl.Engine()
    yield engine
    engine.shutdown()


def test_scheduler_death_fails_pending_and_new_calls(fake_engine: sgl.Engine) -> None:
    outcome: dict[str, Any] = {}

    def pending() -> None:
        try:
            outcome["result"] = fake_engine.generate("hello", {"max_new_tokens": 4})
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=pending)
    thread.start()
    time.sleep(0.5)  # the request reached the scheduler, which never answers
    assert thread.is_alive()
    os.kill(fake_engine._handle.process.pid, signal.SIGKILL)
    thread.join(timeout=10)
    assert not thread.is_alive(), "the pending call hung"
    error = outcome["error"]
    assert isinstance(error, GenerateError) and error.status == 503
    assert "the scheduler process died (exit code -9)" in str(error)
    with pytest.raises(GenerateError, match="scheduler process died"):
        fake_engine.generate("hello")
    with pytest.raises(GenerateError, match="scheduler process died"):
        fake_engine.get_server_info()
    assert not fake_engine.alive
    started = time.monotonic()
    fake_engine.shutdown()
    assert time.monotonic() - started < 5


def test_engine_left_running_is_shut_down_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "leave_it_running.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import sgl, sgl.engine.launch, sgl.model_loader
        from _fake_scheduler import start_fake_scheduler
        from _toy_tokenizers import byte_level_bpe

        if __name__ == "__main__":
            sgl.engine.launch.start_scheduler = start_fake_scheduler
            sgl.model_loader.load_tokenizer = lambda path: byte_level_bpe()
            engine = sgl.Engine()
            print(engine._handle.process.pid, flush=True)
    """))
    marker = tmp_path / "marker.txt"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SGL_FAKE_SCHEDULER_MARKER": str(marker)})
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert "Traceback" not in done.stderr, done.stderr
    assert marker.read_text() == "shutdown request\n"  # a clean shutdown, not a kill
