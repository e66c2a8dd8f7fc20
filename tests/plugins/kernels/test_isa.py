"""What ``sgl_kernels_cpu.isa`` makes of a CPU's features: torch's ``_get_cpu_capability()``
(whose key names differ between torch versions: FMA is ``fma3`` in torch 2.x), with
/proc/cpuinfo's flags where torch has no key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sgl_kernels_cpu import isa

#: torch 2.13's dict on an AMD EPYC without AVX-512 (abridged; every AVX-512 and AMX key False)
AVX2_ONLY = {"avx": True, "avx2": True, "fma3": True, "fma4": False, "f16c": True,
             "avx512_f": False, "avx512_bw": False, "avx512_vl": False, "avx512_dq": False,
             "avx512_bf16": False, "amx_bf16": False, "amx_tile": False, "amx_int8": False}
AVX512 = {**AVX2_ONLY, "avx512_f": True, "avx512_bw": True, "avx512_vl": True,
          "avx512_dq": True}
AVX512_BF16 = {**AVX512, "avx512_bf16": True}
AMX = {**AVX512_BF16, "amx_bf16": True, "amx_tile": True, "amx_int8": True}
#: Linux's flags of the AVX2-only CPU, for a torch that lacks keys
PROC_AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}


@pytest.fixture
def cpu_as(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``cpu_as(caps, proc=set(), machine="x86_64", amx=True)``: detect_isa() with torch's
    capability dict ``caps`` (None: this torch has no ``_get_cpu_capability``), /proc/cpuinfo's
    flags ``proc``, ``platform.machine()`` and the OS granting AMX or not."""

    def detect(caps: dict | None, proc: set[str] | frozenset = frozenset(),
               machine: str = "x86_64", amx: bool = True) -> str:
        if caps is None:
            monkeypatch.delattr(torch._C._cpu, "_get_cpu_capability", raising=False)
        else:
            monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: dict(caps),
                                raising=False)
        monkeypatch.setattr(isa, "_proc_cpu_flags", lambda: set(proc), raising=False)
        monkeypatch.setattr(isa.platform, "machine", lambda: machine)
        monkeypatch.setattr(isa, "_amx_permitted", lambda: amx)
        isa.detect_isa.cache_clear()
        return isa.detect_isa()

    isa.detect_isa.cache_clear()
    yield detect
    isa.detect_isa.cache_clear()  # the next caller detects this CPU again


def test_avx2_only_cpu_with_torchs_fma3_key(cpu_as) -> None:
    """torch 2.x calls FMA ``fma3``: an AVX2-only CPU is at avx2, not none."""
    assert cpu_as(AVX2_ONLY) == "avx2"


def test_avx512_levels(cpu_as) -> None:
    assert cpu_as(AVX512) == "avx512"
    assert cpu_as(AVX512_BF16) == "avx512_bf16"
    assert cpu_as(AMX) == "amx"


def test_amx_only_where_the_os_grants_it(cpu_as) -> None:
    assert cpu_as(AMX, amx=False) == "avx512_bf16"


def test_amx_needs_its_int8_tiles_too(cpu_as) -> None:
    """The amx level multiplies int8 weights (sgl::linear_w8a8) with AMX-INT8 tiles."""
    assert cpu_as({**AMX, "amx_int8": False}) == "avx512_bf16"


def test_an_older_torchs_fma_key(cpu_as) -> None:
    caps = {k: v for k, v in AVX2_ONLY.items() if k != "fma3"}
    assert cpu_as({**caps, "fma": True}) == "avx2"
    assert cpu_as({**caps, "fma": False}) == "none"


def test_without_fma_avx2_or_f16c_no_kernel_level(cpu_as) -> None:
    assert cpu_as({**AVX2_ONLY, "fma3": False}) == "none"
    assert cpu_as({**AVX2_ONLY, "avx2": False}) == "none"
    assert cpu_as({**AVX2_ONLY, "f16c": False}) == "none"  # the quantized matmuls' scales
    # an AVX-512 CPU always has both; without them it is not run at avx2 either
    assert cpu_as({**AVX512, "fma3": False}) == "avx512"


def test_keys_torch_lacks_come_from_proc_cpuinfo(cpu_as) -> None:
    """Where torch has no key for a feature, Linux's flag decides; where it has one, torch's
    answer stands."""
    no_fma = {k: v for k, v in AVX2_ONLY.items() if k != "fma3"}
    assert cpu_as(no_fma, PROC_AVX2) == "avx2"
    assert cpu_as(no_fma, PROC_AVX2 - {"fma"}) == "none"
    assert cpu_as({}, PROC_AVX2) == "avx2"
    assert cpu_as(None, PROC_AVX2) == "avx2"  # a torch without _get_cpu_capability
    avx512_flags = PROC_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert cpu_as({}, avx512_flags) == "avx512"
    assert cpu_as({}, avx512_flags | {"avx512_bf16"}) == "avx512_bf16"
    assert cpu_as(AVX2_ONLY, avx512_flags) == "avx2"  # torch's False stands


def test_not_x86_64_is_none(cpu_as) -> None:
    assert cpu_as(AMX, machine="aarch64") == "none"


def test_this_cpu_agrees_with_linuxs_flags() -> None:
    """Unpatched: the level torch's flags give this CPU is the one /proc/cpuinfo's give (an
    AVX2-only CPU read as ``none`` went unnoticed while torch's FMA key was misspelled)."""
    proc = isa._proc_cpu_flags()
    if isa.platform.machine() not in ("x86_64", "AMD64") or not proc:
        pytest.skip("not x86-64 Linux")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= proc:
        expected = "avx512_bf16" if "avx512_bf16" in proc else "avx512"
    else:
        expected = "avx2" if {"avx2", "fma"} <= proc else "none"
    got = isa.detect_isa()
    if got == "amx":
        assert expected == "avx512_bf16" and {"amx_bf16", "amx_tile", "amx_int8"} <= proc
    else:
        assert got == expected
