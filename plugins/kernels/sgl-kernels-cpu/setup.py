"""Builds sgl's CPU kernels at install time into ``sgl_kernels_cpu/_C*.so``.

The kernels (``csrc/*.c``: C11 with per-function target attributes, so one build runs on any
x86-64 CPU) are compiled with C flags, ``csrc/torch_ops.cpp`` (the torch operators)
against torch's headers, and the two are linked into one library. Without a working C and C++
compiler, or not on x86-64, the package installs without it and sgl runs its torch code
(``sgl plugins`` says why); a compile error with a working compiler fails the install.
"""

from __future__ import annotations

import platform
import subprocess
import sys

from setuptools import setup

SOURCES_C = ["csrc/pool.c", "csrc/run_op.c", "csrc/kernels_avx512.c", "csrc/kernels_avx2.c",
             "csrc/kernels_quant_avx2.c", "csrc/kernels_quant_avx512.c", "csrc/kernels_w8a8.c",
             "csrc/kernels_w8a8_avx512.c"]
# the AVX-512 kernels again with their instructions in software, where SIMDe's headers are found
# (Debian's libsimde-dev), for the tests of those levels on any CPU; at -O1, which compiles it in
# under a minute (-O2 takes 3-4 minutes of SIMDe's inlining) and runs the tests about as fast
SOURCES_EMULATED = ["csrc/kernels_avx512_emulated.c"]
HEADERS = ["csrc/cpu_kernels.h", "csrc/kernels.h", "csrc/jobs.h", "csrc/vec_avx2.h",
           "csrc/isa_emulation.h", "csrc/quant_round_x.h"]
# -ffp-contract=off: a * b + c stays two roundings, as in torch; -fno-wrapv undoes the -fwrapv of
# Python's own CFLAGS (defined signed overflow slows the loops down)
# (-Wno-psabi: the emulated copy passes 512-bit vectors without AVX-512, which gcc notes)
C_FLAGS = ["-O2", "-fPIC", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off", "-fno-wrapv",
           "-Wno-psabi"]


def _runs(compiler: str) -> bool:
    """Whether ``compiler --version`` runs."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True).returncode == 0
    except OSError:
        return False


def _extensions() -> tuple[list, dict]:
    if platform.machine() not in ("x86_64", "AMD64"):
        print("sgl-kernels-cpu: not x86-64, installing without the compiled kernels")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension, get_cxx_compiler

    class Build(BuildExtension):
        """Compiles the C kernels with C flags first, then the operators. Without a working C
        and C++ compiler the package installs without them; with one, a compile error fails
        the install (a broken kernel must not pass as a machine without a compiler)."""

        def build_extensions(self) -> None:
            missing = [cc for cc in (self.compiler.compiler_so[0], get_cxx_compiler())
                       if not _runs(cc)]
            if missing:
                print(f"sgl-kernels-cpu: no working compiler ({', '.join(missing)}); installing "
                      "without the compiled kernels, sgl runs its torch code", file=sys.stderr)
                self.extensions = []
                return
            super().build_extensions()

        def build_extension(self, ext) -> None:
            ext.extra_objects = self.compiler.compile(
                SOURCES_C, output_dir=self.build_temp, include_dirs=["csrc"],
                extra_postargs=C_FLAGS) + self.compiler.compile(
                SOURCES_EMULATED, output_dir=self.build_temp, include_dirs=["csrc"],
                extra_postargs=[*C_FLAGS, "-O1"])
            super().build_extension(ext)

    extension = CppExtension(
        "sgl_kernels_cpu._C", ["csrc/torch_ops.cpp"], include_dirs=["csrc"],
        extra_compile_args=["-O2"], depends=[*SOURCES_C, *SOURCES_EMULATED, *HEADERS])
    return [extension], {"build_ext": Build.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
