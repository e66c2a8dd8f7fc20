"""How each engine of the comparison is started, checked and stopped.

Every server runs in its own session (process group) on a free port of 127.0.0.1, its output in a
log file under the run's folder; stopping it signals the whole group, so vLLM's engine-core
children and sgl's scheduler and detokenizer go with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from compare.peers import Peers


class EngineError(RuntimeError):
    """An engine would not start; the message holds the end of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerSpec:
    """One engine as a command line.

    :param name: the key in results and tables (``sgl``, ``vllm``, ``llama-server-bf16``...).
    :param label: how the table and charts name it.
    :param settings: what the docs print about how it ran (threads, slots, dtype).
    """

    name: str
    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    settings: str = ""
    startup_timeout: float = 600.0


class RunningServer:
    """A started :class:`ServerSpec`; use as a context manager."""

    def __init__(self, spec: ServerSpec, port: int, log_path: Path) -> None:
        self.spec = spec
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(spec.command, env={**os.environ, **spec.env},
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        """Wait for ``/health`` 200 and a model in ``/v1/models``."""
        import httpx

        deadline = time.monotonic() + self.spec.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.spec.name} exited with code {self.proc.returncode} "
                                  f"while starting: {self.last_line()} (log: {self.log_path})")
            try:
                health = httpx.get(self.base_url + "/health", timeout=5)
                models = httpx.get(self.base_url + "/v1/models", timeout=5)
                if health.status_code == 200 and models.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise EngineError(f"{self.spec.name} not ready after {self.spec.startup_timeout:.0f} s: "
                          f"{self.last_line()} (log: {self.log_path})")

    def last_line(self) -> str:
        """The log's last non-empty line: usually the error."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else "(no output)"

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        # children that outlived the leader (an engine core) go too
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def __enter__(self) -> RunningServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "auto": "dtype auto"}


def sgl_spec(model: Path, port: int, *, threads: int | None, max_running: int,
             dtype: str = "bfloat16", name: str = "sgl", kind: str | None = None,
             int8_activations: str | None = None,
             quantization: str | None = None) -> ServerSpec:
    """``sgl serve`` of ``model``: a Hugging Face folder (served dense, or as ``quantization``
    says: ``w8a8_int8`` for ``sgl-w8a8``) or a GGUF file of ``kind`` (served with its quantized
    blocks, sgl's default; ``name`` ``sgl-gguf-<kind>``)."""
    command = [sys.executable, "-m", "sgl", "serve", "--model-path", str(model),
               "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
               "--max-running-requests", str(max_running), "--log-level", "warning"]
    if quantization:
        command += ["--quantization", quantization]
    if threads:
        command += ["--num-threads", str(threads)]
    if int8_activations:  # else sgl's default (auto: on for a GGUF file)
        command += ["--int8-activations", int8_activations]
    rounding = f"int8 activations {int8_activations}, " if int8_activations else ""
    weights = f"{kind.upper()} GGUF weights, " if kind else (
        f"--quantization {quantization}, " if quantization else "")
    label = f"sgl, GGUF {kind.upper()}" if kind else (
        f"sgl, {quantization}" if quantization else "sgl")
    return ServerSpec(name, label, command,
                      settings=f"{weights}{rounding}"
                               f"{_DTYPE_NAMES.get(dtype, dtype)}, {threads or 'default'} "
                               f"scheduler thread(s), "
                               f"max {max_running} running requests, radix cache on")


def vllm_spec(peers: Peers, model: Path, port: int, *, cpus: str, kv_gib: int) -> ServerSpec:
    command = [str(peers.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--dtype", "bfloat16", "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", peers.model.slug]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": cpus,
           "VLLM_LOGGING_LEVEL": "WARNING"}
    return ServerSpec("vllm", "vLLM (vllm-cpu)", command, env=env,
                      settings=f"bf16, OpenMP threads bound to CPUs {cpus}, {kv_gib} GiB KV")


def llama_server_spec(peers: Peers, kind: str, port: int, *, slots: int, threads: int,
                      ctx_per_slot: int, repack: bool = True) -> ServerSpec:
    """llama-server on the ``kind`` GGUF; ``repack`` False adds ``--no-repack`` (engine
    ``llama-server-<kind>-norepack``), which AMX CPUs always get."""
    binary = peers.llama_server
    if binary is None:
        raise EngineError("llama-server is not built")
    command = [str(binary), "-m", str(peers.gguf(kind)), "--host", "127.0.0.1",
               "--port", str(port), "-t", str(threads), "-np", str(slots),
               "-c", str(slots * ctx_per_slot), "-no-kvu", "--alias", peers.model.slug,
               "--no-webui"]
    settings = (f"{kind.upper()} GGUF, {threads} threads, {slots} slots of {ctx_per_slot} "
                f"tokens")
    name, label = f"llama-server-{kind}", f"llama-server {kind.upper()}"
    from sgl_kernels_cpu.isa import has_feature

    if kind != "bf16" and has_feature("amx_int8"):
        # ggml's AMX int8 matmul (picked for quantized weights on CPUs with AMX) dies with
        # SIGSEGV in ggml_backend_amx_mul_mat on AMX CPUs (a Sapphire Rapids VM); --no-repack
        # keeps the weights in ggml's plain CPU buffers there. Elsewhere llama.cpp repacks its
        # Q4_0/Q4_K blocks for its AVX2/AVX-512 kernels by default.
        command.append("--no-repack")
        settings += ", --no-repack (its AMX path crashes on AMX CPUs)"
    elif not repack:
        command.append("--no-repack")
        settings += ", --no-repack"
    if not repack:
        name, label = f"{name}-norepack", f"{label} --no-repack"
    return ServerSpec(name, label, command, settings=settings)
