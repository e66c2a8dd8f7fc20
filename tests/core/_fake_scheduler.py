"""A stand-in scheduler process for Engine tests that need no model: it reports ready at once,
reads requests and never answers them (so a request stays pending until the test kills it).
With ``SGL_FAKE_SCHEDULER_MARKER`` set it notes a ShutdownRequest in that file."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from typing import Any

from sgl.engine.launch import SchedulerHandle


def fake_scheduler_main(endpoints: dict[str, str], conn: Any, vocab_size: int,
                        marker: str | None) -> None:
    import zmq

    from sgl.engine.messages import SchedulerInfo, ShutdownRequest

    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # closing never waits for a gone peer
    pull = ctx.socket(zmq.PULL)
    pull.connect(endpoints["requests"])
    conn.send(SchedulerInfo(ok=True, model_path="fake", architecture="Fake", dtype="float32",
                            context_length=64, vocab_size=vocab_size, max_total_tokens=1024))
    while True:
        if pull.poll(100) and isinstance(pull.recv_pyobj(), ShutdownRequest):
            if marker:
                with open(marker, "a") as f:
                    f.write("shutdown request\n")
            break
    pull.close(linger=0)
    ctx.term()


def start_fake_scheduler(settings: Any, pm: Any, vocab_size: int = 400) -> SchedulerHandle:
    """Drop-in for :func:`sgl.engine.launch.start_scheduler`."""
    ipc_dir = tempfile.mkdtemp(prefix="sgl-fake-ipc-")
    endpoints = {"requests": f"ipc://{ipc_dir}/requests", "outputs": f"ipc://{ipc_dir}/outputs"}
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    marker = os.environ.get("SGL_FAKE_SCHEDULER_MARKER")
    process = ctx.Process(target=fake_scheduler_main,
                          args=(endpoints, child, vocab_size, marker),
                          name="sgl-fake-scheduler", daemon=True)
    process.start()
    child.close()
    return SchedulerHandle([process], endpoints, ipc_dir, [parent])
