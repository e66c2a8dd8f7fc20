/* The kernels' interface (run_op.c, pool.c) that the torch operators (torch_ops.cpp) call.
 *
 * Every kernel call is one sgl_op: the function (`kind`) and its arguments in the function's
 * order as 64-bit integers (a pointer as its address, a float as its 32-bit pattern). The
 * operators build one per call and run it with sgl_run_op; while a forward is recorded they also
 * keep it, and sgl_replay runs the kept sequence again in one call. */
#ifndef SGL_CPU_KERNELS_H
#define SGL_CPU_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    SGL_OP_LINEAR_BF16_AMX = 1,
    SGL_OP_LINEAR_F32 = 2,
    SGL_OP_RMSNORM = 3,
    SGL_OP_SILU_MUL = 4,
    SGL_OP_ROTARY = 5,
    SGL_OP_EMBEDDING = 6,
    SGL_OP_DECODE_ATTENTION = 7,
    SGL_OP_ARGMAX_F32 = 8,
    SGL_OP_LINEAR_BF16_AVX512 = 9,
    SGL_OP_EXTEND_ATTENTION = 10,
    /* the same kernels for AVX2 + FMA (kernels_avx2.c), with the same arguments */
    SGL_OP_LINEAR_BF16_AVX2 = 11,
    SGL_OP_LINEAR_F32_AVX2 = 12,
    SGL_OP_RMSNORM_AVX2 = 13,
    SGL_OP_SILU_MUL_AVX2 = 14,
    SGL_OP_ROTARY_AVX2 = 15,
    SGL_OP_DECODE_ATTENTION_AVX2 = 16,
    SGL_OP_ARGMAX_F32_AVX2 = 17,
    SGL_OP_EXTEND_ATTENTION_AVX2 = 18,
    /* the quantized matmuls and embedding lookup (kernels_quant_avx2.c), at every level */
    SGL_OP_LINEAR_QUANT_AVX2 = 19,
    SGL_OP_EMBEDDING_QUANT = 20,
    /* the quantized matmuls on AVX-512 (kernels_quant_avx512.c), the arguments of 19 */
    SGL_OP_LINEAR_QUANT_AVX512 = 21,
    /* the int8 matmul (kernels_w8a8.c at every level, kernels_w8a8_avx512.c at the AVX-512
       ones; the AVX-512 kind takes one more argument, AMX tiles allowed) */
    SGL_OP_LINEAR_W8A8_AVX2 = 22,
    SGL_OP_LINEAR_W8A8_AVX512 = 23,
};

#define SGL_OP_ARGS 26

typedef struct {
    int64_t kind;
    int64_t a[SGL_OP_ARGS];
} sgl_op;

/* The version of the kernels (sgl_kernels_cpu.library.VERSION) where they were compiled for
   x86-64, 0 elsewhere (every call then fails). */
int sgl_kernels_version(void);
/* Whether this build has the AVX-512 levels' kernels in software (kernels_avx512_emulated.c). */
int sgl_emulation_available(void);
/* Run the AVX-512 levels' kernels in software (on) or as compiled for the CPU (off); 0 when
   asked for emulation this build lacks. */
int sgl_set_emulation(int on);
/* Use `threads` threads (the caller included) from now on; returns the number in use. */
int sgl_set_threads(int threads);
/* Run one call: the kernel's return code (0 for success). */
int sgl_run_op(const sgl_op *op);
/* Run `n` calls in order: 0, or 1 + the index of the first that failed (nothing after it runs). */
int64_t sgl_replay(const sgl_op *ops, int64_t n);
/* Run `parts` independent sequences of calls at once, each on one kernel thread with its kernels
   on that thread alone (the parts of one decode batch, sgl.engine.cpu_graph): failed[p] is
   sgl_replay's result for part p. With one kernel thread the parts run in turn. */
void sgl_replay_parts(const sgl_op *const *ops, const int64_t *counts, int64_t parts,
                      int64_t *failed);

#ifdef __cplusplus
}
#endif

#endif
