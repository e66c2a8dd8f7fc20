"""pytest helpers for sgl and its plugins (registered through the ``pytest11`` entry point).

Fixtures:

* ``plugin_manager`` -- a fresh plugin manager with every installed plugin loaded.
* ``register_plugin`` -- ``register_plugin(obj, name=None)`` adds an inline plugin (a module or
  an object with ``@sgl.hookimpl`` methods) to ``plugin_manager`` for the test's duration.
* ``tiny_llama_config`` -- a tiny random-weight ``transformers.LlamaConfig``.
* ``cpu_device`` -- ``torch.device("cpu")``.
* ``one_torch_thread`` -- torch on one thread for the test (as the scheduler runs it on 2 cores).
* ``restore_kernel_threads`` -- the test may call ``sgl.kernels.cpu.set_threads``; the count in
  use before it is restored afterwards.
* ``cpu_isa`` -- the test runs once at each instruction-set level of
  :func:`sgl.kernels.cpu.isa_levels` this CPU has (capped by ``SGL_CPU_ISA``), kernels included
  or not; the fixture's value is the level. ``kernel_isa`` -- likewise, only at the levels where
  sgl's kernels run; ``avx512_isa`` -- only at those with the AVX-512 kernels (not ``avx2``).
  ``model_isa`` -- ``cpu_isa`` at module scope, for a model loaded once per
  level. ``cpu_isa``, ``kernel_isa`` and ``avx512_isa`` also run at the levels above the CPU's
  that the kernel library emulates in software (:func:`sgl.kernels.cpu.emulated_isa_levels`;
  test ids ``<level>-emulated``; ``SGL_CPU_EMULATE=0`` leaves them out), so every level's
  kernels are checked on any CPU; the model-parity tests (``model_isa``) run at the CPU's own
  levels only. The report header names the levels tested, those emulated and those left out,
  and the summary counts the tests passed at each.

And :class:`ServerProcess`, which runs ``sgl serve`` on a free loopback port for a test.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from sgl.plugins import SglPluginManager

__all__ = ["CAPITAL_QUESTION", "ServerProcess", "free_port", "write_tiny_llama"]

#: a chat question the bundled SmolLM2 answers "The capital of France is Paris." (then its end
#: of turn) greedily at every kernel level, in float32 and bfloat16, with int8 activations on
#: and off, and under Ollama's default repeat penalty. The bare "What is the capital of
#: France?" is a near tie between "The" and "L'" for this 135M model: llama.cpp's arithmetic
#: on the same file (int8 activations) answers "L'Étoile, la Marseillaise, ...".
CAPITAL_QUESTION = "What is the capital of France? Answer with the city name only."


def write_tiny_llama(path: Path, **overrides: Any) -> Path:
    """Save a random-weight Llama (transformers' initialisation, seed 0) at ``path``: 3 layers
    of width 64, 4 query and 2 key/value heads, a 300-token vocabulary, untied, unless
    ``overrides`` (``LlamaConfig`` fields) say otherwise. Returns ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=160,
                                  num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``sgl serve`` in a subprocess on a free port of 127.0.0.1; stopped by :meth:`stop`."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 log_path: Path | None = None, startup_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = [sys.executable, "-m", "sgl", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), *args]
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.args, env={**os.environ, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sgl serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"sgl serve not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def plugin_manager() -> SglPluginManager:
    from sgl.plugins import create_plugin_manager

    return create_plugin_manager()


@pytest.fixture
def register_plugin(plugin_manager: SglPluginManager) -> Iterator[Any]:
    registered: list[Any] = []

    def register(obj: Any, name: str | None = None) -> Any:
        plugin_manager.register(obj, name=name)
        registered.append(obj)
        plugin_manager.__dict__.pop("registries", None)  # rebuild on next access
        return obj

    yield register
    for obj in registered:
        plugin_manager.unregister(obj)
    plugin_manager.__dict__.pop("registries", None)


@pytest.fixture
def tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, tie_word_embeddings=False)


@pytest.fixture
def cpu_device() -> torch.device:
    import torch

    return torch.device("cpu")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test, as the scheduler runs it on a 2-core machine; sgl's
    CPU matmul kernels (and so the recorded decode forwards) are used only then."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def restore_kernel_threads() -> Iterator[None]:
    """The size of sgl's kernel thread pool before the test, set again after it."""
    from sgl.kernels import cpu

    before = cpu.kernel_threads()
    yield
    cpu.set_threads(before)


#: the levels with the AVX-512 kernels (``avx512_isa``); at ``avx2`` their AVX2 versions run
AVX512_LEVELS = ("amx", "avx512_bf16", "avx512")
#: the fixtures that run a test once per level: which levels (None: all), their scope, and
#: whether they add the emulated levels
LEVEL_FIXTURES = {"cpu_isa": (None, "function", True),
                  "kernel_isa": ("kernels", "function", True),
                  "avx512_isa": ("avx512", "function", True),
                  "model_isa": (None, "module", False)}


def emulated_levels_to_test() -> list[str]:
    """The levels above the CPU's that the tests run emulated (see the module docstring): those
    the kernel library emulates, up to ``SGL_CPU_ISA``'s cap; none with ``SGL_CPU_EMULATE=0``."""
    from sgl.kernels import cpu

    if os.environ.get("SGL_CPU_EMULATE") == "0":
        return []
    cap = cpu.requested_isa()
    return [lv for lv in cpu.emulated_isa_levels()
            if cap == "auto" or cpu.isa_at_least(cap, lv)]


def isa_levels_to_test(kernels_only: bool = False, avx512_only: bool = False,
                       emulated: bool = False) -> list[str]:
    """The levels of :func:`sgl.kernels.cpu.isa_levels` this process can run (the CPU's best,
    capped by ``SGL_CPU_ISA``, and all below it; with ``emulated`` also those of
    :func:`emulated_levels_to_test`); with ``kernels_only`` only those where sgl's kernels run,
    and none of those where the library cannot be built; with ``avx512_only`` only those of
    :data:`AVX512_LEVELS`."""
    from sgl.kernels import cpu

    detected, cap = cpu.detected_isa(), cpu.requested_isa()
    top = detected if cap == "auto" or cpu.isa_at_least(cap, detected) else cap
    levels = list(cpu.isa_levels()[cpu.isa_levels().index(top):])
    if emulated:
        levels = [lv for lv in emulated_levels_to_test() if lv not in levels] + levels
    if top in cpu.kernel_levels() and cpu.cpu_isa() == "none":  # the library cannot be built
        levels = [lv for lv in levels if lv not in cpu.kernel_levels()]
    if avx512_only:
        return [lv for lv in levels if lv in AVX512_LEVELS]
    return [lv for lv in levels if lv in cpu.kernel_levels()] if kernels_only else levels


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for name, (which, scope, emulated) in LEVEL_FIXTURES.items():
        if name in metafunc.fixturenames:
            emulated_levels = emulated_levels_to_test() if emulated else []
            levels: list[Any] = [
                pytest.param(lv, id=f"{lv}-emulated") if lv in emulated_levels else lv
                for lv in isa_levels_to_test(which == "kernels", which == "avx512", emulated)]
            if not levels:  # reported as a level not run, never counted as passing
                from sgl.kernels import cpu

                what = (f"AVX-512 level ({', '.join(AVX512_LEVELS)})" if which == "avx512"
                        else "level")
                levels = [pytest.param("none", id="no-kernel-level", marks=pytest.mark.skip(
                    reason=f"no {what} of sgl's CPU kernels here: {cpu.describe_isa()}"))]
            metafunc.parametrize(name, levels, indirect=True, scope=scope)


def _at_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    from sgl.kernels import cpu

    before = cpu.requested_isa()
    level = request.param
    emulated = level in cpu.emulated_isa_levels()
    got = cpu.set_isa(level, emulate=emulated)
    if got != level:
        raise RuntimeError(f"could not run the CPU kernels at {level} (got {got})")
    try:
        yield level
    finally:
        cpu.set_isa(before, emulate=None)


@pytest.fixture
def cpu_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The instruction-set level this run of the test is at (see the module docstring)."""
    yield from _at_isa(request)


@pytest.fixture
def kernel_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel level this run of the test is at (see the module docstring)."""
    yield from _at_isa(request)


@pytest.fixture
def avx512_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The AVX-512 kernel level (:data:`AVX512_LEVELS`) this run of the test is at."""
    yield from _at_isa(request)


@pytest.fixture(scope="module")
def model_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """``cpu_isa`` for a module-scoped fixture (a model loaded once per level): the tests that
    use it run grouped by level."""
    yield from _at_isa(request)


def pytest_report_header(config: pytest.Config) -> str:
    from sgl.kernels import cpu

    tested, emulated = isa_levels_to_test(), emulated_levels_to_test()
    lacking = [lv for lv in cpu.isa_levels() if lv not in tested and lv not in emulated]
    return (f"sgl CPU ISA levels tested: {', '.join(tested)}; emulated in software (kernel "
            f"and replay tests): {', '.join(emulated) or '-'}; not on this CPU or capped: "
            f"{', '.join(lacking) or '-'} (CPU: {cpu.describe_isa()})")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            level = next((callspec.params[k] for k in LEVEL_FIXTURES if k in callspec.params),
                         None)
            if level is not None:
                emulated = "-emulated" in callspec.id
                item.user_properties.append(("sgl_isa", f"{level} emulated" if emulated
                                             else level))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("passed", []):
        for key, value in getattr(report, "user_properties", ()):
            if key == "sgl_isa":
                counts[value] = counts.get(value, 0) + 1
    if counts:
        from sgl.kernels import cpu

        names = [f"{lv} emulated" for lv in cpu.isa_levels()] + list(cpu.isa_levels())
        line = ", ".join(f"{lv} {counts[lv]}" for lv in names if lv in counts)
        terminalreporter.write_line(f"sgl CPU ISA levels, tests passed at each: {line}")


#: seconds the interpreter has to exit once the run is over (``SGL_TEST_EXIT_GRACE_S``)
EXIT_GRACE_S = float(os.environ.get("SGL_TEST_EXIT_GRACE_S", "120"))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over, so the interpreter must exit: a thread, executor or child process that
    a test left running would otherwise hold it until CI's time limit, with nothing printed.
    After :data:`EXIT_GRACE_S` seconds, print every thread's stack and exit with status 1."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.__stderr__)


def run_cli(args: Sequence[str], env: dict[str, str] | None = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``sgl ARGS`` in a fresh interpreter (plugins are discovered anew each time)."""
    return subprocess.run([sys.executable, "-m", "sgl", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
