"""Starting and stopping the scheduler process (used by the server and by ``sgl.Engine``)."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sgl.engine.messages import SchedulerInfo

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from sgl.config import ServerSettings
    from sgl.plugins import SglPluginManager

__all__ = ["SchedulerHandle", "SchedulerStartError", "start_scheduler"]

logger = logging.getLogger("sgl.launch")


class SchedulerStartError(RuntimeError):
    """The scheduler process exited or reported an error before it was ready."""


@dataclass
class SchedulerHandle:
    process: BaseProcess
    endpoints: dict[str, str]
    ipc_dir: str
    ready_conn: Any
    info: SchedulerInfo | None = None

    def wait_ready(self, timeout: float = 900.0) -> SchedulerInfo:
        """Block until the scheduler has loaded the model; raise if it died or failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_conn.poll(0.2):
                try:
                    info: SchedulerInfo = self.ready_conn.recv()
                except EOFError:
                    info = SchedulerInfo(ok=False, error=(
                        "the scheduler process exited before it reported (see its log above). "
                        "If you start sgl.Engine from a script, put that code under "
                        "`if __name__ == \"__main__\":`: the scheduler process is started with "
                        "multiprocessing's spawn method, which imports your script again"))
                if not info.ok:
                    self.stop()
                    raise SchedulerStartError(f"the scheduler failed to start: {info.error}")
                self.info = info
                return info
            if not self.process.is_alive():
                raise SchedulerStartError(
                    f"the scheduler process exited with code {self.process.exitcode} before it "
                    "was ready; see its log above")
        self.stop()
        raise SchedulerStartError(f"the scheduler was not ready after {timeout:.0f} s")

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask politely (the caller sent ShutdownRequest, if it could), then terminate, then kill."""
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def start_scheduler(settings: ServerSettings, pm: SglPluginManager) -> SchedulerHandle:
    """Spawn the scheduler process. It loads the plugins ``pm`` loaded (no rediscovery) and the
    model, then reports a :class:`SchedulerInfo` through :meth:`SchedulerHandle.wait_ready`."""
    from sgl.engine.scheduler import run_scheduler_process

    ipc_dir = tempfile.mkdtemp(prefix="sgl-ipc-")
    endpoints = {"requests": f"ipc://{ipc_dir}/requests", "outputs": f"ipc://{ipc_dir}/outputs"}
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=run_scheduler_process,
        args=(settings.to_dict(), pm.loaded_records(), endpoints, child_conn),
        name="sgl-scheduler",
        daemon=True,
    )
    process.start()
    child_conn.close()
    return SchedulerHandle(process, endpoints, ipc_dir, parent_conn)
