/* One call, and a recorded sequence of calls.
 *
 * sgl_run_op runs one kernel from an sgl_op (cpu_kernels.h): `kind` names the function, `a` holds
 * its arguments in order as 64-bit integers (pointers, integers; a float argument as its 32-bit
 * pattern). The torch operators (torch_ops.cpp) call it, and sgl_replay runs a recorded sequence
 * of calls (sgl.engine.cpu_graph) in one call. */
#include "cpu_kernels.h"
#include "kernels.h"

#include <string.h>

#if defined(__x86_64__)

int sgl_kernels_version(void) { return 15; }

/* the AVX-512 levels' kernels in use: compiled for the CPU, or emulated (sgl_set_emulation) */
static const sgl_avx512_kernels *avx512 = &sgl_avx512_kernels_native;

int sgl_emulation_available(void) { return sgl_avx512_kernels_emulated.linear_f32 != NULL; }

int sgl_set_emulation(int on) {
    if (on && !sgl_emulation_available()) return 0;
    avx512 = on ? &sgl_avx512_kernels_emulated : &sgl_avx512_kernels_native;
    return 1;
}

/* Embedding lookup: row t of out (row stride o_stride elements) = row ids[t] of w [vocab, H]
   (row stride w_stride), `es`-byte elements. -1 (nothing written) when an id is outside
   [0, vocab). */
int sgl_embedding(const void *w, int64_t w_stride, int64_t vocab, const int64_t *ids, int64_t T,
                  void *out, int64_t o_stride, int64_t H, int64_t es) {
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return -1;
    for (int64_t t = 0; t < T; t++)
        memcpy((char *)out + t * o_stride * es, (const char *)w + ids[t] * w_stride * es,
               (size_t)(H * es));
    return 0;
}

static inline float f32_bits(int64_t v) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)v;
    return u.f;
}

#define P(i) ((void *)(intptr_t)a[i])

int sgl_run_op(const sgl_op *op) {
    const int64_t *a = op->a;
    switch (op->kind) {
    case SGL_OP_LINEAR_BF16_AMX:
    case SGL_OP_LINEAR_BF16_AVX2:
        return (op->kind == SGL_OP_LINEAR_BF16_AMX ? avx512->linear_bf16_amx
                                                   : sgl_linear_bf16_avx2)(
            P(0), a[1], P(2), P(3), a[4], a[5], a[6], a[7], P(8));
    case SGL_OP_LINEAR_BF16_AVX512:
        return avx512->linear_bf16_avx512(P(0), a[1], P(2), P(3), a[4], a[5], a[6], a[7], P(8),
                                      (int)a[9]);
    case SGL_OP_LINEAR_F32:
    case SGL_OP_LINEAR_F32_AVX2:
        return (op->kind == SGL_OP_LINEAR_F32 ? avx512->linear_f32 : sgl_linear_f32_avx2)(
            P(0), a[1], P(2), P(3), a[4], a[5], a[6], a[7], P(8));
    case SGL_OP_RMSNORM:
    case SGL_OP_RMSNORM_AVX2:
        return (op->kind == SGL_OP_RMSNORM ? avx512->rmsnorm : sgl_rmsnorm_avx2)(
            P(0), a[1], P(2), a[3], P(4), a[5], P(6), P(7), a[8], a[9], a[10], a[11],
            f32_bits(a[12]), (int)a[13]);
    case SGL_OP_SILU_MUL:
    case SGL_OP_SILU_MUL_AVX2:
        return (op->kind == SGL_OP_SILU_MUL ? avx512->silu_mul : sgl_silu_mul_avx2)(
            P(0), a[1], P(2), a[3], a[4], a[5], (int)a[6]);
    case SGL_OP_ROTARY:
    case SGL_OP_ROTARY_AVX2:
        return (op->kind == SGL_OP_ROTARY ? avx512->rotary : sgl_rotary_avx2)(
            P(0), a[1], P(2), a[3], P(4), a[5], P(6), a[7], a[8], a[9], a[10], (int)a[11]);
    case SGL_OP_EMBEDDING:
        return sgl_embedding(P(0), a[1], a[2], P(3), a[4], P(5), a[6], a[7], a[8]);
    case SGL_OP_DECODE_ATTENTION:
    case SGL_OP_DECODE_ATTENTION_AVX2:
        return (op->kind == SGL_OP_DECODE_ATTENTION ? avx512->decode_attention
                                                    : sgl_decode_attention_avx2)(
            P(0), a[1], a[2], P(3), a[4], P(5), a[6], P(7), P(8), P(9), a[10], P(11), P(12),
            P(13), P(14), a[15], a[16], a[17], a[18], a[19], a[20], f32_bits(a[21]),
            f32_bits(a[22]), a[23], (int)a[24], (int)a[25]);
    case SGL_OP_ARGMAX_F32:
    case SGL_OP_ARGMAX_F32_AVX2:
        return (op->kind == SGL_OP_ARGMAX_F32 ? avx512->argmax_f32 : sgl_argmax_f32_avx2)(
            P(0), a[1], a[2], a[3], P(4));
    case SGL_OP_EXTEND_ATTENTION:
    case SGL_OP_EXTEND_ATTENTION_AVX2:
        return (op->kind == SGL_OP_EXTEND_ATTENTION ? avx512->extend_attention
                                                    : sgl_extend_attention_avx2)(
            P(0), a[1], P(2), P(3), P(4), a[5], P(6), P(7), P(8), P(9), a[10], P(11), a[12],
            a[13], a[14], a[15], a[16], f32_bits(a[17]), f32_bits(a[18]), a[19], (int)a[20],
            (int)a[21], P(22));
    case SGL_OP_LINEAR_QUANT_AVX2:
        return sgl_linear_quant_avx2(P(0), a[1], P(2), P(3), P(4), a[5], a[6], a[7], a[8], P(9),
                                     (int)a[10], (int)a[11], (int)a[12]);
    case SGL_OP_LINEAR_QUANT_AVX512:
        return avx512->linear_quant(P(0), a[1], P(2), P(3), P(4), a[5], a[6], a[7], a[8], P(9),
                                    (int)a[10], (int)a[11], (int)a[12], (int)a[13]);
    case SGL_OP_LINEAR_W8A8_AVX2:
        return sgl_linear_w8a8_avx2(P(0), a[1], P(2), P(3), P(4), a[5], a[6], a[7], a[8], P(9),
                                    (int)a[10]);
    case SGL_OP_LINEAR_W8A8_AVX512:
        return avx512->linear_w8a8(P(0), a[1], P(2), P(3), P(4), a[5], a[6], a[7], a[8], P(9),
                                   (int)a[10], (int)a[11]);
    case SGL_OP_EMBEDDING_QUANT:
        return sgl_embedding_quant(P(0), P(1), a[2], a[3], P(4), a[5], P(6), a[7], (int)a[8],
                                   (int)a[9], (int)a[10]);
    default:
        return -100;
    }
}

int64_t sgl_replay(const sgl_op *ops, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (sgl_run_op(&ops[i])) return i + 1;
    return 0;
}

/* The parts are the chunks of one pool job, one per thread (a thread still free when its own
   part is done takes a part not begun yet). The pool is busy with that job while the parts run,
   so the kernels they call run their own loops on the calling thread alone (pool.c,
   sgl_parallel_for): each part is a sequence of single-threaded kernel calls, with no barrier
   between the threads until the end. */
typedef struct {
    const sgl_op *const *ops;
    const int64_t *counts;
    int64_t *failed;
} replay_parts_job;

static void replay_part_range(void *ctx, int64_t begin, int64_t end) {
    const replay_parts_job *j = ctx;
    for (int64_t p = begin; p < end; p++) j->failed[p] = sgl_replay(j->ops[p], j->counts[p]);
}

void sgl_replay_parts(const sgl_op *const *ops, const int64_t *counts, int64_t parts,
                      int64_t *failed) {
    replay_parts_job job = {ops, counts, failed};
    sgl_parallel_for(replay_part_range, &job, parts, 1);
}

#undef P

#else
int sgl_kernels_version(void) { return 0; }
int sgl_emulation_available(void) { return 0; }
int sgl_set_emulation(int on) { return !on; }
int sgl_set_threads(int threads) { (void)threads; return 1; }
int sgl_run_op(const sgl_op *op) { (void)op; return -100; }
int64_t sgl_replay(const sgl_op *ops, int64_t n) { (void)ops; return n > 0 ? 1 : 0; }
void sgl_replay_parts(const sgl_op *const *ops, const int64_t *counts, int64_t parts,
                      int64_t *failed) {
    for (int64_t p = 0; p < parts; p++) failed[p] = sgl_replay(ops[p], counts[p]);
}
#endif
