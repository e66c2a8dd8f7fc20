"""Which instruction-set level sgl's CPU kernels run at, and the controls of their library.

The kernels are a plugin (``plugins/kernels/sgl-kernels-cpu``, compiled when it is installed): a
:class:`~sgl.kernels.library.KernelLibrary` that implements the ``torch.ops.sgl`` operators of
:mod:`sgl.kernels.ops` for CPU tensors and knows the CPU: its instruction-set levels
(:attr:`~sgl.kernels.library.KernelLibrary.levels`, best first; :func:`isa_levels` adds
``none``, torch's operators only) and which of them this CPU runs (``docs/kernels.md``). The
layers call the operators once :func:`load` hands them a library, and run their torch code
where it hands them None.

The level is the best the library finds on this CPU, capped by ``SGL_CPU_ISA`` (one of the
levels; ``sgl serve --cpu-isa`` sets it for the server) and by ``SGL_CPU_KERNELS=0``
(``none``); :func:`set_isa` changes it in a running process (the tests run every level the CPU
has this way). With ``SGL_CPU_EMULATE=1`` (or :func:`set_isa`'s ``emulate``) a cap above the
CPU's level runs that level's kernels with their instructions done in software, where the library
can (:meth:`~sgl.kernels.library.KernelLibrary.emulated_levels`): correct and several times
slower, so that the tests check every level's kernels on any CPU. Without the plugin (not
installed, built without its compiled part, ``--disable-plugin kernels-cpu``), or at ``none``,
:func:`load` returns None.

The kernels split their work over :func:`set_threads` threads of their own, and the matmuls run
only when torch is on one thread (with more, torch's OpenMP threads and the kernels' would fight
over the cores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl.kernels import ops  # noqa: F401  (declares the torch.ops.sgl operators)
from sgl.kernels.library import KernelLibrary, KernelLibraryUnavailable, KernelTape
from sgl.kernels.ops import pack_bf16_weight, pack_f32_weight

if TYPE_CHECKING:
    from sgl.plugins import SglPluginManager

__all__ = ["DTYPES", "argmax_rows", "bfloat16_faster", "check_level", "cpu_isa",
           "describe_isa", "detected_isa", "effective_isa", "emulated_isa_levels",
           "emulation_requested", "fits", "isa_at_least", "isa_emulated", "isa_levels",
           "kernel_levels", "kernel_threads", "load", "pack_bf16_weight", "pack_f32_weight",
           "packs_x16", "recording", "requested_isa", "set_isa", "set_threads", "use_plugins"]

logger = logging.getLogger(__name__)

#: tensor dtypes the kernels take
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class _State:
    """This process's kernel library and the level and threads it runs with."""

    loaded: KernelLibrary | None = None  # the library at the level in use; None: torch only
    level: str = "none"  # the level ``loaded`` runs at
    tried: bool = False  # ``loaded`` and ``level`` are decided
    threads: int = 1
    isa_cap: str | None = None  # set_isa's level; None: SGL_CPU_ISA / SGL_CPU_KERNELS decide
    emulate: bool | None = None  # set_isa's emulate; None: SGL_CPU_EMULATE decides
    plugins: SglPluginManager | None = None  # use_plugins'; None: the installed plugins
    library: KernelLibrary | None = None  # the plugin's library, whatever the level
    library_tried: bool = False
    library_missing: str = ""  # why there is no library, for describe_isa


_lock = threading.RLock()
_state = _State()


def kernel_levels() -> tuple[str, ...]:
    """The levels the kernel library has kernels for, best first (a CPU runs its own and all
    below it); none without a library."""
    library = _find_library()
    return tuple(library.levels) if library is not None else ()


def isa_levels() -> tuple[str, ...]:
    """:func:`kernel_levels` and ``none`` (torch's operators only), best first."""
    return (*kernel_levels(), "none")


def fits(*tensors: torch.Tensor | None) -> bool:
    """Whether the elementwise kernels take these tensors: on CPU, 2-D, one dtype of
    :data:`DTYPES`, unit stride in the last dimension, no autograd (None entries are skipped)."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if (t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1 or t.requires_grad
                or t.dtype not in DTYPES or (dtype is not None and t.dtype != dtype)):
            return False
        dtype = t.dtype
    return True


@contextlib.contextmanager
def recording(arena: torch.Tensor | None = None) -> Iterator[KernelTape]:
    """Record the kernel calls this thread makes inside the block, their outputs carved from
    ``arena`` where given (:meth:`~sgl.kernels.library.KernelLibrary.record_begin`); the tape
    is filled when the block ends (empty without the kernels)."""
    tape = KernelTape()
    library = load()
    if library is None:
        yield tape
        return
    library.record_begin(arena)
    try:
        yield tape
    finally:
        recorded = library.record_end()
        tape.library, tape.calls, tape.count = recorded.library, recorded.calls, recorded.count
        tape.inputs, tape.outputs = recorded.inputs, recorded.outputs
        tape.arena_bytes = recorded.arena_bytes


def detected_isa() -> str:
    """The best level of :func:`isa_levels` this CPU runs, as the kernel library finds it
    (``none`` without one)."""
    library = _find_library()
    return library.detect_isa() if library is not None else "none"


def check_level(level: str, where: str) -> str:
    """``level`` normalized; ValueError naming ``where`` unless it is ``auto`` or a level of
    :func:`isa_levels` (without a kernel library any name is taken: it runs as ``none``)."""
    level = level.strip().lower()
    if level != "auto" and level not in isa_levels() and _find_library() is not None:
        raise ValueError(f"{where}={level!r}: expected auto or one of {', '.join(isa_levels())}")
    return level


def requested_isa() -> str:
    """The cap on the level: :func:`set_isa`'s, else ``SGL_CPU_ISA`` (``none`` with
    ``SGL_CPU_KERNELS=0``); ``auto`` for no cap. ValueError for a name not in the ladder."""
    if _state.isa_cap is not None:
        return _state.isa_cap
    if os.environ.get("SGL_CPU_KERNELS", "1") == "0":
        return "none"
    return check_level(os.environ.get("SGL_CPU_ISA", "") or "auto", "SGL_CPU_ISA")


def emulation_requested() -> bool:
    """Whether a cap above the CPU's level may be emulated: :func:`set_isa`'s ``emulate``, else
    ``SGL_CPU_EMULATE=1``."""
    if _state.emulate is not None:
        return _state.emulate
    return os.environ.get("SGL_CPU_EMULATE", "0") == "1"


def emulated_isa_levels() -> tuple[str, ...]:
    """The levels above the CPU's that the kernel library can run in software (none without a
    library)."""
    library = _find_library()
    return tuple(library.emulated_levels()) if library is not None else ()


def isa_at_least(level: str, floor: str) -> bool:
    """Whether ``level`` includes ``floor`` (both names of :func:`isa_levels`; a name the
    library does not know counts as ``none``)."""
    ladder = isa_levels()
    rank = {name: i for i, name in enumerate(ladder)}
    return rank.get(level, len(ladder) - 1) <= rank.get(floor, len(ladder) - 1)


def effective_isa(requested: str) -> str:
    """The level that runs for the cap ``requested`` (see :func:`requested_isa`) on this CPU."""
    if requested == "none":
        return "none"
    detected = detected_isa()
    if (requested != "auto" and requested != detected and emulation_requested()
            and requested in emulated_isa_levels()):
        return requested  # above the CPU's level, in software
    if requested == "auto" or isa_at_least(requested, detected):
        return detected  # never above what the CPU has
    return requested


def isa_emulated() -> bool:
    """Whether the level in use (:func:`cpu_isa`) runs emulated, above what the CPU has."""
    level = cpu_isa()
    return level in kernel_levels() and not isa_at_least(detected_isa(), level)


def cpu_isa() -> str:
    """The level the CPU kernels run at now: the CPU's best, capped (see
    :func:`requested_isa`); ``none`` without a kernel library (see :func:`describe_isa`)."""
    load()
    return _state.level


def describe_isa() -> str:
    """One line for logs and ``sgl plugins``: the level in use and why."""
    level, library = cpu_isa(), _find_library()
    if library is None:
        return f"none ({_state.library_missing})"
    detected, capped = library.detect_isa(), effective_isa(requested_isa())
    parts = [f"CPU has {detected}"]
    if isa_emulated():
        parts.append("emulated in software: correct, several times slower, for tests")
    elif capped != detected:
        parts.append(f"capped at {capped}")
    parts.append(library.describe() if level in library.levels else "torch operators only")
    return f"{level} ({', '.join(parts)})"


def set_isa(level: str, emulate: bool | None = None) -> str:
    """Run the kernels at ``level`` (a name of :func:`isa_levels`, or ``auto``: the CPU's best
    or ``SGL_CPU_ISA``'s) from now on, never above what the CPU has unless ``emulate`` (None:
    ``SGL_CPU_EMULATE`` decides) and the library can emulate it; returns the level in use
    (:func:`cpu_isa`). Weights packed before keep the layout of their level."""
    level = check_level(level, "cpu isa")
    with _lock:
        _state.isa_cap = None if level == "auto" else level
        _state.emulate = emulate
        _state.tried = False
    return cpu_isa()


def use_plugins(plugin_manager: SglPluginManager | None) -> None:
    """Take the CPU kernel library from ``plugin_manager``'s registries (the plugins this
    process loaded: ``--disable-plugin kernels-cpu`` leaves the kernels out); None: from the
    installed plugins, found on first use."""
    with _lock:
        _state.plugins = plugin_manager
        _state.library, _state.library_tried, _state.library_missing = None, False, ""
        _state.tried = False


def _find_library() -> KernelLibrary | None:
    """The registered ``cpu`` kernel library, built on the first call; None (with the reason in
    ``library_missing``) where there is none or it cannot run here. The plugins are those of
    :func:`use_plugins`, else the installed ones
    (:func:`sgl.plugins.installed_plugin_manager`)."""
    st = _state
    with _lock:
        if st.library_tried:
            return st.library
        st.library_tried = True
        pm = st.plugins
        if pm is None:
            from sgl.plugins import installed_plugin_manager

            pm = installed_plugin_manager()
        try:
            registry = pm.registries.kernels
        except RuntimeError as exc:  # plugins that clash (reported where the registries are used)
            st.library_missing = f"no kernel library: {exc}"
            return None
        if "cpu" not in registry.names():
            st.library_missing = ("no CPU kernel library: install sgl-kernels-cpu "
                                  "(plugins/kernels/sgl-kernels-cpu)")
            if "kernels-cpu" in pm.records and not pm.records["kernels-cpu"].available:
                st.library_missing += f"; it is unavailable: {pm.records['kernels-cpu'].reason}"
            return None
        entry = registry.entry("cpu")
        try:
            st.library = entry.load()()
        except KernelLibraryUnavailable as exc:
            st.library_missing = str(exc)
            logger.warning("sgl's CPU kernels are off, torch runs everything (slower): %s", exc)
        except Exception as exc:  # a broken plugin must not stop the server: torch runs instead
            st.library_missing = f"plugin {entry.owner!r} failed: {type(exc).__name__}: {exc}"
            logger.warning("sgl's CPU kernels are off: %s", st.library_missing)
        return st.library


def load() -> KernelLibrary | None:
    """The kernel library, set to this process's level (see :func:`cpu_isa`); None where the
    kernels cannot be used (the level ``none``, no kernel library, another architecture)."""
    st = _state
    if st.tried:
        return st.loaded
    with _lock:
        if st.tried:
            return st.loaded
        level = effective_isa(requested_isa())
        library = _find_library() if level != "none" else None
        st.loaded, st.level = None, "none"
        if library is not None and level in library.levels:
            emulated = not isa_at_least(library.detect_isa(), level)
            library.set_level(level, emulated=emulated)
            st.loaded, st.level = library, level
            if emulated:
                logger.warning("sgl's CPU kernels run at %s emulated in software (this CPU has "
                               "%s): correct, several times slower; meant for tests", level,
                               library.detect_isa())
        st.tried = True
        return st.loaded


def set_threads(threads: int) -> int:
    """Use ``threads`` threads (the caller included) in the kernels from now on; returns the
    number in use (1 without the kernels)."""
    library = load()
    if library is None:
        return 1
    with _lock:
        _state.threads = int(library.set_threads(max(1, int(threads))))
    return _state.threads


def kernel_threads() -> int:
    """Threads of the kernels (see :func:`set_threads`)."""
    return _state.threads


def bfloat16_faster() -> bool:
    """Whether the kernels, at the level in use, decode bfloat16 weights faster than float32
    (:meth:`~sgl.kernels.library.KernelLibrary.bfloat16_faster`); False without them."""
    library = load()
    return library is not None and library.bfloat16_faster(cpu_isa())


def round_x_faster() -> bool:
    """Whether the kernels, at the level in use, multiply quantized weights faster with
    ``round_x`` (see :meth:`KernelLibrary.round_x_faster`); False without the kernels."""
    library = load()
    return library is not None and library.round_x_faster()


def packs_x16() -> bool:
    """Whether the kernels, at the level in use, take ``round_x`` weights in the x16 layouts
    (see :meth:`KernelLibrary.packs_x16`); False without the kernels."""
    library = load()
    return library is not None and library.packs_x16()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[B, V]`` logits (first maximum), through the kernel for CPU
    float32 rows, which reads each row once in vectors (torch's CPU argmax is slow over a large
    vocabulary)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.stride(1) == 1 and not logits.requires_grad and logits.shape[1] > 0
            and load() is not None):
        return torch.ops.sgl.argmax(logits)
    return logits.max(dim=-1).indices  # the same index as argmax, and faster on CPU
