"""Builds sgl's CPU kernels at install time into ``sgl_kernels_cpu/_C*.so``.

``csrc/cpu_kernels.c`` (the kernels, C11 with per-function target attributes, so one build runs
on any x86-64 CPU) is compiled with C flags, ``csrc/torch_ops.cpp`` (the torch operators)
against torch's headers, and the two are linked into one library. The extension is optional: where it
cannot be built (no C/C++ compiler, not x86-64) the package installs without it, and sgl runs
its torch code (``sgl plugins`` says why).
"""

from __future__ import annotations

import platform
import sys

from setuptools import setup

SOURCES_C = ["csrc/cpu_kernels.c"]
# -ffp-contract=off: a * b + c stays two roundings, as in torch; -fno-wrapv undoes the -fwrapv of
# Python's own CFLAGS (defined signed overflow slows the loops down)
C_FLAGS = ["-O2", "-fPIC", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off", "-fno-wrapv"]


def _extensions() -> tuple[list, dict]:
    if platform.machine() not in ("x86_64", "AMD64"):
        print("sgl-kernels-cpu: not x86-64, installing without the compiled kernels")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class Build(BuildExtension):
        """Compiles the C kernels with C flags first (inside the extension's build, so that a
        failure leaves the optional extension out instead of failing the install)."""

        def build_extensions(self) -> None:
            try:  # torch checks the C++ compiler first: no compiler ends here
                super().build_extensions()
            except Exception as exc:  # noqa: BLE001 - any failure: install without them
                print(f"sgl-kernels-cpu: the kernels could not be compiled ({exc}); installing "
                      "without them, sgl runs its torch code", file=sys.stderr)

        def build_extension(self, ext) -> None:
            ext.extra_objects = self.compiler.compile(
                SOURCES_C, output_dir=self.build_temp, include_dirs=["csrc"],
                extra_postargs=C_FLAGS)
            super().build_extension(ext)

    extension = CppExtension(
        "sgl_kernels_cpu._C", ["csrc/torch_ops.cpp"], include_dirs=["csrc"],
        extra_compile_args=["-O2"], depends=[*SOURCES_C, "csrc/cpu_kernels.h"], optional=True)
    return [extension], {"build_ext": Build.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
