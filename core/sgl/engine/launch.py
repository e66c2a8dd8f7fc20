"""Starting and stopping the scheduler process (used by the server and by ``sgl.Engine``)."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sgl.engine.messages import SchedulerInfo
from sgl.parallel.base import RankInfo, RequestRouter

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
    """The scheduler processes this node started: one, or one per tensor-parallel rank (the
    leader, which owns ``endpoints``, first when this node has it)."""

    processes: list[BaseProcess]
    #: ``"requests"``: the requests socket of each replica (one without data parallelism);
    #: ``"outputs"``: the one socket every replica answers on
    endpoints: dict[str, Any]
    ipc_dir: str
    ready_conns: list[Any]
    info: SchedulerInfo | None = None
    #: picks a replica for each request when there are several (the strategy's)
    router: RequestRouter | None = None

    @property
    def process(self) -> BaseProcess:
        """The first process (the leader on node 0)."""
        return self.processes[0]

    def wait_ready(self, timeout: float = 900.0) -> SchedulerInfo:
        """Block until every process has loaded its model; raise if one died or failed.
        Returns the first process's report (the leader's on node 0)."""
        deadline = time.monotonic() + timeout
        reports: dict[int, SchedulerInfo] = {}
        while len(reports) < len(self.processes):
            if time.monotonic() >= deadline:
                self.stop()
                raise SchedulerStartError(f"the scheduler was not ready after {timeout:.0f} s")
            for i, conn in enumerate(self.ready_conns):
                if i in reports or not conn.poll(0.2 / len(self.processes)):
                    continue
                try:
                    info: SchedulerInfo = conn.recv()
                except EOFError:
                    info = SchedulerInfo(ok=False, error=(
                        f"{self.processes[i].name} exited before it reported (see its log "
                        "above). If you start sgl.Engine from a script, put that code under "
                        "`if __name__ == \"__main__\":`: the scheduler process is started with "
                        "multiprocessing's spawn method, which imports your script again"))
                if not info.ok:
                    self.stop(timeout=1)
                    raise SchedulerStartError(f"the scheduler failed to start: {info.error}")
                reports[i] = info
            for i, process in enumerate(self.processes):
                if i not in reports and not process.is_alive() and not self.ready_conns[i].poll():
                    self.stop(timeout=1)
                    raise SchedulerStartError(
                        f"{process.name} exited with code {process.exitcode} before it was "
                        "ready; see its log above")
        self.info = reports[0]
        return self.info

    @property
    def alive(self) -> bool:
        """Whether every process still runs (one rank gone stops them all)."""
        return all(p.is_alive() for p in self.processes)

    def death_reason(self) -> str:
        """Which process is gone and how, for the message that fails the requests."""
        dead = [p for p in self.processes if not p.is_alive()]
        if not dead:
            return "the scheduler is running"
        if len(self.processes) == 1:
            return f"the scheduler process died (exit code {dead[0].exitcode})"
        return "; ".join(f"the scheduler process of {p.name.removeprefix('sgl-scheduler ')} "
                         f"died (exit code {p.exitcode})" for p in dead)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask politely (the caller sent ShutdownRequest, if it could), then terminate, then kill."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def start_scheduler(settings: ServerSettings, pm: SglPluginManager) -> SchedulerHandle:
    """Spawn this node's scheduler processes: one, or the ranks of the parallel strategy the
    settings turn on (:mod:`sgl.parallel`). They load the plugins ``pm`` loaded (no
    rediscovery) and the model, then report through :meth:`SchedulerHandle.wait_ready`."""
    from sgl.engine.scheduler_process import run_scheduler_process
    from sgl.parallel.select import parallel_strategy

    chosen = parallel_strategy(settings, pm.registries)
    ipc_dir = tempfile.mkdtemp(prefix="sgl-ipc-")
    outputs = f"ipc://{ipc_dir}/outputs"
    ctx = multiprocessing.get_context("spawn")
    ranks: list[RankInfo | None] = [None]
    if chosen is not None:
        ranks = [dataclasses.replace(rank, rendezvous_dir=ipc_dir) for rank in
                 chosen[1].local_ranks(settings.dist_init_addr or _free_loopback_address())]
    replicas = sorted({0 if rank is None else rank.replica for rank in ranks})
    requests = {replica: f"ipc://{ipc_dir}/requests" + (f"-{replica}" if replica else "")
                for replica in replicas}
    processes, conns = [], []
    for rank in ranks:
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        name = "sgl-scheduler" if rank is None else f"sgl-scheduler {rank.label}"
        endpoints = {"requests": requests[0 if rank is None else rank.replica], "outputs": outputs}
        process = ctx.Process(
            target=run_scheduler_process,
            args=(settings.to_dict(), pm.loaded_records(), endpoints, child_conn, rank),
            name=name, daemon=True)
        process.start()
        child_conn.close()
        processes.append(process)
        conns.append(parent_conn)
    if chosen is not None:
        logger.info("parallel strategy %s: ranks %s on this node", chosen[0],
                    ", ".join(str(r.rank) for r in ranks if r is not None))
    endpoints = {"requests": [requests[r] for r in replicas], "outputs": outputs}
    router = chosen[1].request_router() if chosen is not None else None
    return SchedulerHandle(processes, endpoints, ipc_dir, conns, router=router)


def _free_loopback_address() -> str:
    """``127.0.0.1:PORT`` with a port nothing listens on now, where one machine's ranks meet."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"
