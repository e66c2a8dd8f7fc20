"""The Makefile's install step sets up the Debian packages the suite uses itself, so that `make
serve` and `make test` need nothing else on a bare machine (issue 55, item 0): as root or with
password-less sudo it installs them with apt-get; otherwise it stops with the command to run.

The packages are installed here, so the test names one that does not exist through the
Makefile's own check variable (``SYSTEM_PACKAGES_CHECK``): the only way to make a package
missing without removing one from the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MISSING = 'missing=" sgl-test-no-such-package"'


def make(*args: str, user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    return subprocess.run([*(user or []), "make", "-s", "-C", str(ROOT), *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_nothing_to_do_when_the_packages_are_there() -> None:
    result = make("system-packages")
    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr


def test_without_root_it_stops_with_the_command_to_run() -> None:
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get on this system: the step only notes what is missing")
    user: list[str] = []
    if os.getuid() == 0:  # run the step as nobody, who has neither root nor sudo
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop to another user")
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    elif subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        pytest.skip("this user has password-less sudo: the step would install")
    result = make("system-packages", f"SYSTEM_PACKAGES_CHECK={MISSING}", user=user)
    assert result.returncode != 0
    assert "sudo apt-get install -y sgl-test-no-such-package" in result.stderr, result.stderr
    assert "SGL_SYSTEM_PACKAGES=skip" in result.stderr


def test_skip_goes_on_without_them() -> None:
    result = make("system-packages", f"SYSTEM_PACKAGES_CHECK={MISSING}",
                  "SGL_SYSTEM_PACKAGES=skip")
    assert result.returncode == 0, result.stderr


def test_ci_runs_plain_make_test() -> None:
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1].strip() == "make test"
    assert not any("apt-get" in line for line in commands)
