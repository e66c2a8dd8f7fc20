"""A disk cache of what transformers derives from a GGUF file's metadata.

Building the tokenizer (and reading the config) from GGUF metadata parses the whole vocabulary
and merges, several seconds of CPU per process. The server, every scheduler process and each
``sgl.Engine`` need them, so the first one saves the result with ``save_pretrained`` under
``$SGL_CACHE_DIR`` (default ``~/.cache/sgl``), keyed by the file's path, size and mtime and the
transformers version, and the others load the saved folder in a fraction of a second.
Set ``SGL_CACHE_DIR=off`` to disable it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["cached_from_gguf", "cache_root"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def cache_root() -> Path | None:
    value = os.environ.get("SGL_CACHE_DIR", "")
    if value.lower() in ("off", "0", "none"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "sgl"


def _key(gguf: Path, kind: str) -> str:
    import transformers

    stat = gguf.stat()
    raw = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{kind}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def cached_from_gguf(gguf: Path, kind: str, build: Callable[[], T],
                     load: Callable[[str], T]) -> T:
    """``load(folder)`` from the cache if present, else ``build()`` and save it there.

    Any problem with the cache falls back to ``build()``: the cache only ever saves time.
    """
    root = cache_root()
    if root is None:
        return build()
    folder = root / "gguf" / _key(gguf, kind)
    if folder.is_dir():
        try:
            return load(str(folder))
        except Exception as exc:  # a damaged entry: rebuild it
            logger.warning("ignoring the damaged cache entry %s: %s", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    obj = build()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        obj.save_pretrained(str(staging))  # type: ignore[attr-defined]
        try:
            os.replace(staging, folder)  # atomic; another process may have won the race
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:  # read-only home, full disk, ...: serve without the cache
        logger.debug("could not cache %s of %s: %s", kind, gguf, exc)
    return obj
