/* What the kernel files share: the thread pool and per-thread scratch (pool.c), and the entry
 * points of the kernels, one file per instruction-set level (kernels_avx512.c for AMX,
 * AVX512-BF16 and AVX-512; kernels_avx2.c for AVX2 + FMA), which run_op.c calls. Not part of the
 * library's interface (that is cpu_kernels.h). Each AVX2 kernel takes the arguments of its
 * AVX-512 counterpart, and returns the same codes. */
#ifndef SGL_KERNELS_H
#define SGL_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* -- pool.c ------------------------------------------------------------------------------------ */

typedef void (*sgl_range_fn)(void *ctx, int64_t begin, int64_t end);

/* Run fn(ctx, begin, end) over [0, n) in chunks of `chunk`, on the caller and the pool's helpers. */
void sgl_parallel_for(sgl_range_fn fn, void *ctx, int64_t n, int64_t chunk);
/* The threads in use (sgl_set_threads). */
int sgl_pool_threads(void);
/* The chunk size, from `cap` down to half of it, that deals n items out over `threads` shares
 * most evenly (pool.c). */
int64_t sgl_balanced_chunk(int64_t n, int64_t cap, int threads);
/* Rows per chunk for a row-wise kernel over T rows. */
int64_t sgl_row_chunk(int64_t T);
/* This thread's buffer `slot` (0: bfloat16 copies, 1: float32 work), grown to at least `bytes`
 * and kept; 64-byte aligned; NULL when out of memory. */
void *sgl_scratch(int slot, size_t bytes);

static inline uint16_t *scratch_bf16(int64_t elems) {
    return (uint16_t *)sgl_scratch(0, (size_t)elems * 2);
}
static inline float *scratch_f32(int64_t elems) { return (float *)sgl_scratch(1, (size_t)elems * 4); }

/* -- kernels (the comments at their definitions give the arguments) --------------------------- */

int sgl_linear_bf16_amx(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K, const float *bias);
int sgl_linear_bf16_avx512(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y,
                           int64_t ldy, int64_t M, int64_t N, int64_t K, const float *bias,
                           int dp);
int sgl_linear_bf16_avx2(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y,
                         int64_t ldy, int64_t M, int64_t N, int64_t K, const float *bias);

int sgl_linear_f32(const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, const float *bias);
int sgl_linear_f32_avx2(const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, const float *bias);

void sgl_f32_panel_avx2(const float *x, int64_t ldx, const float *panel, float *y, int64_t ldy,
                        int64_t M, int64_t cols, int64_t K, const float *bias);
int sgl_linear_quant_avx2(const void *x, int64_t ldx, const uint8_t *qw, const uint16_t *sc,
                          void *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                          const float *bias, int dtype, int bits, int round_x);
void sgl_bf16_panel_avx512(const uint16_t *x, int64_t ldx, const float *xf, int64_t ldxf,
                           const uint16_t *panel, uint16_t *y, int64_t ldy, int64_t M,
                           int64_t cols, int64_t K, const float *bias, int dp);
/* x [M, K] fp32 rounded per block of 32 to int8 (kernels_quant_avx2.c): xq [M, K], and per row
   and block dx = max|x| / 127, dx * sum(q) and sum(q) into xd, xs, xi [M, K/32] */
void sgl_round_x_blocks(const float *xf, int64_t ldx, int64_t M, int64_t KB, int8_t *xq,
                        float *xd, float *xs, int32_t *xi);
int sgl_linear_quant_avx512(const void *x, int64_t ldx, const uint8_t *qw, const uint16_t *sc,
                            void *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                            const float *bias, int dtype, int bits, int round_x, int level);
/* sgl::linear_w8a8 (kernels_w8a8.c, kernels_w8a8_avx512.c): x's rows rounded to int8 (shared
   by every level), the AVX2 product, and the AVX-512 one (AMX tiles from W8A8_AMX_ROWS rows
   where `amx`, else AVX512-VNNI, else the AVX2 one) */
void sgl_w8a8_round_rows(const void *x, int64_t ldx, int dtype, int64_t M, int64_t Mp,
                         int64_t K, int64_t ldq, int8_t *xq, float *sx, int32_t *xs);
int sgl_linear_w8a8_avx2(const void *x, int64_t ldx, const uint8_t *wp, const float *sw,
                         void *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                         const float *bias, int dtype);
int sgl_linear_w8a8_avx512(const void *x, int64_t ldx, const uint8_t *wp, const float *sw,
                           void *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                           const float *bias, int dtype, int amx);
int sgl_embedding_quant(const uint8_t *qw, const uint16_t *sc, int64_t vocab, int64_t K,
                        const int64_t *ids, int64_t T, void *out, int64_t o_stride, int dtype,
                        int bits, int x16);

int sgl_rmsnorm(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                void *res_out, int64_t ro_stride, const void *weight, void *out,
                int64_t o_stride, int64_t T, int64_t H, int64_t heads, float eps, int dtype);
int sgl_rmsnorm_avx2(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                     void *res_out, int64_t ro_stride, const void *weight, void *out,
                     int64_t o_stride, int64_t T, int64_t H, int64_t heads, float eps,
                     int dtype);

int sgl_silu_mul(const void *x, int64_t x_stride, void *out, int64_t o_stride, int64_t T,
                 int64_t d, int dtype);
int sgl_silu_mul_avx2(const void *x, int64_t x_stride, void *out, int64_t o_stride, int64_t T,
                      int64_t d, int dtype);

int sgl_rotary(const void *x, int64_t x_stride, const void *cs, int64_t cs_stride,
               const int64_t *pos, int64_t cs_rows, void *out, int64_t T, int64_t H, int64_t D,
               int64_t rot, int dtype);
int sgl_rotary_avx2(const void *x, int64_t x_stride, const void *cs, int64_t cs_stride,
                    const int64_t *pos, int64_t cs_rows, void *out, int64_t T, int64_t H,
                    int64_t D, int64_t rot, int dtype);

int sgl_embedding(const void *w, int64_t w_stride, int64_t vocab, const int64_t *ids, int64_t T,
                  void *out, int64_t o_stride, int64_t H, int64_t es);

int sgl_argmax_f32(const float *x, int64_t stride, int64_t B, int64_t V, int64_t *out);
int sgl_argmax_f32_avx2(const float *x, int64_t stride, int64_t B, int64_t V, int64_t *out);

int sgl_decode_attention(const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_new,
                         int64_t k_new_stride, const void *v_new, int64_t v_new_stride,
                         void *k_pool, void *v_pool, const int64_t *table, int64_t table_stride,
                         const int64_t *rows, const int64_t *lens, const int64_t *loc, void *out,
                         int64_t out_stride_t, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                         int64_t Dv, float scale, float softcap, int64_t window, int dtype,
                         int bf16_dot);
int sgl_decode_attention_avx2(const void *q, int64_t q_stride_t, int64_t q_stride_h,
                              const void *k_new, int64_t k_new_stride, const void *v_new,
                              int64_t v_new_stride, void *k_pool, void *v_pool,
                              const int64_t *table, int64_t table_stride, const int64_t *rows,
                              const int64_t *lens, const int64_t *loc, void *out,
                              int64_t out_stride_t, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                              int64_t Dv, float scale, float softcap, int64_t window, int dtype,
                              int bf16_dot);

int sgl_extend_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                         const int64_t *table, int64_t table_stride, const int64_t *rows,
                         const int64_t *q_starts, const int64_t *prefix_lens,
                         const int64_t *extend_lens, int64_t B, void *out, int64_t out_stride,
                         int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, float scale,
                         float softcap, int64_t window, int dtype, int bf16_dot,
                         const int32_t *tree_bits);
int sgl_extend_attention_avx2(const void *q, int64_t q_stride, const void *k_pool,
                              const void *v_pool, const int64_t *table, int64_t table_stride,
                              const int64_t *rows, const int64_t *q_starts,
                              const int64_t *prefix_lens, const int64_t *extend_lens, int64_t B,
                              void *out, int64_t out_stride, int64_t Hq, int64_t Hk, int64_t D,
                              int64_t Dv, float scale, float softcap, int64_t window, int dtype,
                              int bf16_dot, const int32_t *tree_bits);

/* The kernels of kernels_avx512.c and kernels_quant_avx512.c, as run_op.c calls them: compiled for the CPU
 * (sgl_avx512_kernels_native) and again with the instructions in software
 * (sgl_avx512_kernels_emulated, kernels_avx512_emulated.c: every entry NULL where the build
 * had no SIMDe). */
typedef struct {
    __typeof__(sgl_linear_bf16_amx) *linear_bf16_amx;
    __typeof__(sgl_linear_bf16_avx512) *linear_bf16_avx512;
    __typeof__(sgl_linear_f32) *linear_f32;
    __typeof__(sgl_rmsnorm) *rmsnorm;
    __typeof__(sgl_silu_mul) *silu_mul;
    __typeof__(sgl_rotary) *rotary;
    __typeof__(sgl_argmax_f32) *argmax_f32;
    __typeof__(sgl_decode_attention) *decode_attention;
    __typeof__(sgl_extend_attention) *extend_attention;
    __typeof__(sgl_linear_quant_avx512) *linear_quant;
    __typeof__(sgl_linear_w8a8_avx512) *linear_w8a8;
} sgl_avx512_kernels;

extern const sgl_avx512_kernels sgl_avx512_kernels_native;
extern const sgl_avx512_kernels sgl_avx512_kernels_emulated;

#endif
