"""Builds sgl's CPU kernels at install time into ``sgl_kernels_cpu/_C*.so``.

``csrc/cpu_kernels.c`` (the kernels, C11 with per-function target attributes, so one build runs
on any x86-64 CPU) is compiled as a static library with C flags, and ``csrc/torch_ops.cpp`` (the
torch operators) against torch's headers, linked with it. The extension is optional: where it
cannot be built (no C/C++ compiler, not x86-64) the package installs without it, and sgl runs
its torch code (``sgl plugins`` says why).
"""

from __future__ import annotations

import platform

from setuptools import setup

SOURCES_C = ["csrc/cpu_kernels.c"]
# -ffp-contract=off: a * b + c stays two roundings, as in torch
C_FLAGS = ["-O2", "-fPIC", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off"]


def _extensions() -> tuple[list, dict, list]:
    if platform.machine() not in ("x86_64", "AMD64"):
        print("sgl-kernels-cpu: not x86-64, installing without the compiled kernels")
        return [], {}, []
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    extension = CppExtension(
        "sgl_kernels_cpu._C", ["csrc/torch_ops.cpp"], include_dirs=["csrc"],
        extra_compile_args=["-O2"], optional=True)
    library = ("sgl_cpu_kernels_c", {"sources": SOURCES_C, "cflags": C_FLAGS,
                                     "include_dirs": ["csrc"]})
    return [extension], {"build_ext": BuildExtension.with_options(use_ninja=False)}, [library]


ext_modules, cmdclass, libraries = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass, libraries=libraries)
