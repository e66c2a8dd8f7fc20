"""The split of the cores between torch's threads and sgl's kernel threads (``sgl.threads``),
at simulated core counts, under real affinity masks of 1 and 2 cores, and as ``sgl serve``
checks the flags."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sgl_testing import run_cli
from sgl.threads import ThreadPlan, check_thread_counts, plan_threads, usable_cores


@pytest.mark.parametrize("cores", [1, 2, 4, 16, 64])
def test_defaults_give_the_kernels_every_core(cores: int) -> None:
    """Where sgl's kernels run, torch keeps one thread (the kernels and the replays need it)
    and the kernels take every usable core, at any core count; below the kernel levels torch
    takes all cores but one."""
    with_kernels = plan_threads(None, None, kernels=True, cores=cores)
    assert with_kernels == ThreadPlan(torch_threads=1, kernel_threads=cores)
    assert with_kernels.kernels_on
    assert plan_threads(None, None, kernels=False, cores=cores) == ThreadPlan(
        torch_threads=max(1, cores - 1), kernel_threads=1)


def test_explicit_counts_are_kept() -> None:
    assert plan_threads(None, 3, kernels=True, cores=16) == ThreadPlan(1, 3)
    assert plan_threads(1, 8, kernels=True, cores=16) == ThreadPlan(1, 8)
    # torch on several threads: the kernel pool stays at one, the kernels' matmuls are off
    many = plan_threads(12, None, kernels=True, cores=16)
    assert many == ThreadPlan(12, 1) and not many.kernels_on
    # without kernels there is no pool to size, whatever --kernel-threads says
    assert plan_threads(None, 4, kernels=False, cores=16) == ThreadPlan(15, 1)


@pytest.mark.parametrize("num,kernel,message", [
    (2, 2, "--num-threads 2 with --kernel-threads 2: sgl's kernels run only while torch has "
           "one thread"),
    (8, None, "--num-threads 8 is more than the 4 core"),
    (None, 5, "--kernel-threads 5 is more than the 4 core"),
])
def test_counts_that_fight_over_the_cores_are_refused(num: int | None, kernel: int | None,
                                                      message: str) -> None:
    assert message in check_thread_counts(num, kernel, 4)
    with pytest.raises(ValueError, match="core"):
        plan_threads(num, kernel, kernels=True, cores=4)


@pytest.mark.parametrize("mask", [{0}, {0, 1}])
def test_usable_cores_follow_the_affinity_mask(mask: set[int]) -> None:
    """In a child process pinned to ``mask`` (as ``taskset`` does), the default plan and the
    scheduler's configure_threads use that many cores, not the machine's CPU count."""
    if not hasattr(os, "sched_setaffinity") or not mask <= os.sched_getaffinity(0):
        pytest.fail(f"this machine cannot pin a process to cores {sorted(mask)}")
    script = textwrap.dedent(f"""
        import os, torch
        os.sched_setaffinity(0, {sorted(mask)!r})
        from sgl.engine.setup import configure_threads
        from sgl.kernels import cpu
        from sgl.threads import usable_cores
        plan = configure_threads(None, None)
        print(usable_cores(), plan.torch_threads, plan.kernel_threads, torch.get_num_threads(),
              cpu.kernel_threads(), cpu.load() is not None)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    cores, torch_threads, kernel_threads, torch_now, pool_now = map(int, out[:5])
    kernels = out[5] == "True"
    assert cores == len(mask)
    if kernels:
        assert (torch_threads, kernel_threads) == (1, len(mask)) == (torch_now, pool_now)
    else:
        assert (torch_threads, kernel_threads) == (max(1, len(mask) - 1), 1)
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_serve_names_the_flags_that_fight() -> None:
    cores = usable_cores()
    result = run_cli(["serve", "--num-threads", "2", "--kernel-threads", "2"])
    if cores >= 2:
        assert result.returncode == 2, result.stderr
        assert "--num-threads 2 with --kernel-threads 2" in result.stderr
        assert "Traceback" not in result.stderr
    result = run_cli(["serve", "--kernel-threads", str(cores + 1)])
    assert result.returncode == 2, result.stderr
    assert f"--kernel-threads {cores + 1} is more than the {cores} core(s)" in result.stderr
