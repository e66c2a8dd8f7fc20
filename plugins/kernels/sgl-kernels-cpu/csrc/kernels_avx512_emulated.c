/* kernels_avx512.c and kernels_quant_avx512.c compiled a second time, with their AMX,
 * AVX512-BF16, AVX512-VNNI and AVX-512 instructions done in software (isa_emulation.h, on
 * SIMDe), for CPUs that lack them: the tests run each level's kernels on any x86-64 CPU with
 * AVX2 (sgl_cpu::set_level's `emulated`). Built for AVX2 + FMA, so SIMDe implements the
 * 512-bit operations with 256-bit ones; called only where the CPU has those. Where SIMDe's
 * headers are not found the table is empty and no level is emulated. */
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<simde/x86/avx512.h>)
#pragma GCC target("avx2,fma,f16c")
#define SGL_EMULATE_ISA 1
#include "isa_emulation.h"
#include "kernels_avx512.c"
#include "kernels_quant_avx512.c"
#include "kernels_w8a8_avx512.c"
#endif
#endif

#if !defined(SGL_EMULATE_ISA)
#include "kernels.h"

const sgl_avx512_kernels sgl_avx512_kernels_emulated = {0};
#endif
