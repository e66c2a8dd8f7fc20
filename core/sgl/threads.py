"""How the scheduler's threads share the cores: torch's intra-op threads and sgl's kernel threads.

sgl's CPU kernels (the matmuls, the decode attention, the norms; :mod:`sgl.kernels.cpu`) run on
a pool of their own threads and are used only while torch runs on one thread: torch's OpenMP
threads spin at barriers, so the two pools on the same cores would slow each other down, and
with another process busy on a core torch's threads wait for the slowest one at every barrier
(the kernel threads, which claim work chunk by chunk, lose little; docs/benchmarks.md,
"Threads").
So, by default:

* where the kernels run (an instruction-set level of :func:`sgl.kernels.cpu.kernel_levels`),
  torch gets 1 thread and the kernels one thread per core this process may use;
* below those levels torch does everything, on one thread per usable core but one (which the
  HTTP process keeps for tokenizing), and the kernel pool stays at 1.

"Usable cores" is this process's CPU affinity (``taskset``, cgroups cpusets), not the machine's
CPU count. Explicit ``--num-threads`` / ``--kernel-threads`` values are kept, but combinations
that fight over the cores are refused by :func:`check_thread_counts`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

__all__ = ["ThreadPlan", "check_thread_counts", "plan_threads", "take_core_share", "usable_cores"]

logger = logging.getLogger("sgl.threads")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadPlan:
    """torch's intra-op threads and the kernel pool's threads (the caller included)."""

    torch_threads: int
    kernel_threads: int

    @property
    def kernels_on(self) -> bool:
        """Whether sgl's matmul kernels (and so the replayed decode forwards) can run."""
        return self.torch_threads == 1


def check_thread_counts(num_threads: int | None, kernel_threads: int | None,
                        cores: int) -> str | None:
    """Why this explicit combination would fight over ``cores`` cores (a message naming the
    flags), or None when it is fine."""
    if num_threads is not None and num_threads > cores:
        return (f"--num-threads {num_threads} is more than the {cores} core(s) this process "
                f"may use; torch's threads would share cores and wait on each other")
    if kernel_threads is not None and kernel_threads > cores:
        return (f"--kernel-threads {kernel_threads} is more than the {cores} core(s) this "
                f"process may use")
    if (num_threads or 1) > 1 and (kernel_threads or 1) > 1:
        return (f"--num-threads {num_threads} with --kernel-threads {kernel_threads}: sgl's "
                "kernels run only while torch has one thread, and the two pools would fight "
                "over the cores; set one of them (for sgl's kernels: --num-threads 1)")
    return None


def plan_threads(num_threads: int | None, kernel_threads: int | None, *, kernels: bool,
                 cores: int | None = None) -> ThreadPlan:
    """The thread counts for explicit values (None: the default) where sgl's kernels do or do
    not run (``kernels``) on ``cores`` usable cores (default: :func:`usable_cores`).
    ValueError for a combination :func:`check_thread_counts` refuses."""
    cores = usable_cores() if cores is None else cores
    problem = check_thread_counts(num_threads, kernel_threads, cores)
    if problem:
        raise ValueError(problem)
    if num_threads is None:
        if kernels and kernel_threads is not None and kernel_threads > 1:
            num_threads = 1  # the kernels' pool was asked for: torch must leave the cores
        else:
            num_threads = 1 if kernels else max(1, cores - 1)
    if not kernels:
        kernel_threads = 1  # no kernel runs, so no pool (the scheduler warns about the flag)
    elif kernel_threads is None:
        kernel_threads = cores if num_threads == 1 else 1
    return ThreadPlan(torch_threads=num_threads, kernel_threads=kernel_threads)


def take_core_share(index: int, count: int) -> bool:
    """Pin this process to share ``index`` of ``count`` equal shares of the cores it may use
    (one scheduler process of several on one machine: tensor-parallel ranks, data-parallel
    replicas), so that its threads, sized afterwards from :func:`usable_cores`, do not fight the
    others'. With fewer cores than processes each takes one core, processes sharing cores in
    turn. Returns whether processes share cores."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux: leave the threads where they are
        return True
    share = max(1, len(cores) // count)
    start = index * share % len(cores)
    sharing = len(cores) < count
    if sharing:
        logger.warning("%d scheduler processes on %d core(s): they share cores and wait on "
                       "each other", count, len(cores))
    os.sched_setaffinity(0, cores[start:start + share])
    return sharing
