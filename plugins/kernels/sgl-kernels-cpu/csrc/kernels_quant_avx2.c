/* The quantized matmuls (sgl::linear_q4, sgl::linear_q8) and embedding lookup (sgl::embedding_q)
 * on AVX2 + FMA + F16C, for every level: an AVX-512 CPU runs them too, as it runs any AVX2 code.
 *
 * y[M, N] = x[M, K] . W^T (+ bias), W in the q4 or q8 layout of sgl.kernels.quant: per block of
 * 32 values along K, small integers q and float16 (d, m), W = d q + m. x is read as fp32 (a
 * bfloat16 x is widened once, into scratch); the sums are float32, the result rounded once to
 * x's dtype. Two paths, by the number of rows:
 *
 *   below Q_PANEL_ROWS: 32 columns at a time, each block widened to d q + m (bytes to int32
 *                       to fp32, one FMA per 8 values) into a 32 x 32 panel on the stack,
 *                       which every row multiplies one k at a time.
 *   Q_PANEL_ROWS up:    32 columns at a time widened into one panel of sgl_linear_f32's layout
 *                       in the thread's scratch (8 x 8 transposes), then multiplied by the
 *                       float32 matmul's 6 x 16 tiles.
 *
 * Both paths do the same float32 operations in the same order for every row and column (one
 * chain of FMAs over k in order, then the bias), so a row's result does not depend on the
 * other rows of the call: a request's tokens are the same alone, in a batch or after a
 * prefix-cache hit.
 *
 * Columns (in groups of 32) are shared out over the pool's threads.
 *
 * With round_x (any M) each block of each row of x is first rounded to int8 (sgl_round_x_blocks,
 * llama.cpp's Q8 activations) and the products are integers: vpmaddubsw / vpmaddwd per block,
 * summed exactly, then scaled by d * dx, plus m * dx * sum(q), in quant_round_x.h's one float
 * sequence; tiles of up to 4 rows x 8 columns, the columns shared out in groups of 8.
 *
 * The lookup of token embeddings in a quantized table (sgl::embedding_q) is here too: each row
 * widened block by block as the matmuls widen them, d q + m in float32 (exact: fp16 d times a
 * small integer needs at most 19 bits, so the FMA rounds once, as the reference's add does), and
 * stored as float32 or rounded to bfloat16.
 */
#include "jobs.h"
#include "kernels.h"

#include <stdint.h>

#if defined(__x86_64__)
#include "vec_avx2.h"

#define ROUND_X_TARGET AVX2_TARGET
#define ROUND_X_VNNI 0 /* vpmaddubsw + vpmaddwd */
#include "quant_round_x.h"

#define Q_PANEL_ROWS 12 /* from this many rows: widened panels and the float32 tiles */

typedef struct {
    const float *xf; /* x in fp32 */
    const uint8_t *qw;
    const uint16_t *sc;
    void *y;
    const float *bias;
    int64_t ldx, ldy, M, N, KB;
    int dtype, bits;
} linear_quant_job;

/* the 32 values of one block as 4 vectors of fp32, d q + m */
AVX2_TARGET INLINE void dequant_block(const uint8_t *q, const uint16_t *s, const int bits,
                                      __m256 w[4]) {
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16((short)s[0]));
    const __m256 m = _mm256_cvtph_ps(_mm_set1_epi16((short)s[1]));
    __m256i v[4]; /* the integers of values 8i .. 8i + 7 */
    if (bits == 4) { /* byte j: value j (low nibble) and value j + 16 (high nibble) */
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        const __m256i mask = _mm256_set1_epi32(0x0F);
        v[0] = _mm256_and_si256(b0, mask);
        v[1] = _mm256_and_si256(b1, mask);
        v[2] = _mm256_srli_epi32(b0, 4);
        v[3] = _mm256_srli_epi32(b1, 4);
    } else {
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
    }
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[i]), d, m);
}

/* -- few rows: the panels' arithmetic, a block at a time ------------------------------------
 * Below Q_PANEL_ROWS rows the columns are taken 32 at a time; each block of them is widened to
 * d q + m (the FMA of dequant_block) into a 32 x 32 panel on the stack, and every row carries
 * its 32 sums along K one value at a time, as sgl_f32_panel_avx2 does on the panels of many
 * rows: per row and column one chain of FMAs over k = 0 .. K - 1 in order, then the bias added
 * once. So a row's result is the same bits whatever other rows share the call, and whether
 * the call took this path or the panels (greedy decoding must not depend on the batch). */

/* out[i], lane c: bytes 4i .. 4i + 3 of column c's 16 bytes at src + c * stride (c < cols;
   zero past them) */
AVX2_TARGET INLINE void qs_transpose8x4(const uint8_t *src, int64_t stride, int64_t cols,
                                       __m256i out[4]) {
    __m128i row[8];
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++)
        row[c] = c < cols ? _mm_loadu_si128((const __m128i *)(src + c * stride))
                          : _mm_setzero_si128();
    __m256i r[4]; /* r[c]: column c in the low lane, column c + 4 in the high one */
    #pragma GCC unroll 4
    for (int c = 0; c < 4; c++) r[c] = _mm256_set_m128i(row[c + 4], row[c]);
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* The scales of block kb of the 8 columns n0 .. n0 + cols as float32 (d, m), and its integers
   with byte b of dword i of t[i] in lane c (q4: values 4i + b and 4i + b + 16 as nibbles; q8:
   t[0..7], value 4i + b). Columns past cols are zero. */
AVX2_TARGET INLINE void qs_block8(const linear_quant_job *j, int64_t n0, int64_t cols,
                                  int64_t kb, __m256 *d, __m256 *m, __m256i t[8],
                                  const int BITS) {
    const int64_t KB = j->KB, qb = BITS == 4 ? 16 : 32;
    /* each column's float16 (d, m) of the block, gathered (a vector load of pairs stored one
       by one would stall on store forwarding) */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i present = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(cols < 8 ? cols : 8)),
                                               lane);
    const __m256i dm = _mm256_mask_i32gather_epi32(
        _mm256_setzero_si256(), (const int *)(j->sc + (n0 * KB + kb) * 2),
        _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)KB)), present, 4);
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)),
                            _mm256_srli_epi32(dm, 16)), 0xD8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    const uint8_t *q = j->qw + (n0 * KB + kb) * qb;
    qs_transpose8x4(q, KB * qb, cols, t);
    if (BITS == 8) qs_transpose8x4(q + 16, KB * qb, cols, t + 4);
}

/* value k (< 32, constant after unrolling) of the block as 8 columns' d q + m, from qs_block8 */
AVX2_TARGET INLINE __m256 qs_value(const __m256i t[8], __m256 d, __m256 m, const int k,
                                   const int BITS) {
    __m256i v;
    if (BITS == 4) { /* k = 16 h + 4 i + b */
        const int h = k >> 4, i = (k >> 2) & 3, b = k & 3;
        v = _mm256_and_si256(_mm256_srli_epi32(t[i], 8 * b + 4 * h), _mm256_set1_epi32(0x0F));
    } else { /* k = 4 i + b, signed */
        v = _mm256_srai_epi32(_mm256_slli_epi32(t[k >> 2], 24 - 8 * (k & 3)), 24);
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m);
}

/* block kb of the 8 columns n0 .. n0 + cols (zero past them) widened into w[k * 32], k < 32 */
AVX2_TARGET INLINE void qs_widen8(const linear_quant_job *j, int64_t n0, int64_t cols,
                                  int64_t kb, float *w, const int BITS) {
    if (cols <= 0) {
        for (int k = 0; k < 32; k++) _mm256_storeu_ps(w + k * 32, _mm256_setzero_ps());
        return;
    }
    __m256 d, m;
    __m256i t[8];
    qs_block8(j, n0, cols, kb, &d, &m, t, BITS);
    #pragma GCC unroll 32
    for (int k = 0; k < 32; k++) _mm256_storeu_ps(w + k * 32, qs_value(t, d, m, k, BITS));
}

/* One or two rows: the 32 columns' sums in registers over all of K, each block's values
   widened and used at once (no panel); the same chains as qs_rows */
AVX2_TARGET INLINE void qs_direct(const linear_quant_job *j, int64_t n0, int64_t cols,
                                  __m256 *acc, const int BITS, const int ROWS) {
    __m256 a[2][4];
    #pragma GCC unroll 2
    for (int r = 0; r < ROWS; r++)
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++) a[r][g] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < j->KB; kb++) {
        __m256 d[4], m[4];
        __m256i t[4][8];
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++)
            if (8 * g < cols) qs_block8(j, n0 + 8 * g, cols - 8 * g, kb, d + g, m + g, t[g], BITS);
        const float *x = j->xf + kb * 32;
        #pragma GCC unroll 32
        for (int k = 0; k < 32; k++) {
            #pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                if (8 * g >= cols) continue;
                const __m256 w = qs_value(t[g], d[g], m[g], k, BITS);
                #pragma GCC unroll 2
                for (int r = 0; r < ROWS; r++)
                    a[r][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * j->ldx + k), w, a[r][g]);
            }
        }
    }
    #pragma GCC unroll 2
    for (int r = 0; r < ROWS; r++)
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++) acc[r * 4 + g] = a[r][g];
}

/* acc[r][0..3] (the 32 columns' sums of ROWS rows) carried over one block's 32 values of k */
AVX2_TARGET INLINE void qs_rows(const float *x, int64_t ldx, const float *w, __m256 *acc,
                                const int ROWS) {
    __m256 a[2][4];
    #pragma GCC unroll 2
    for (int r = 0; r < ROWS; r++)
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++) a[r][g] = acc[r * 4 + g];
    for (int k = 0; k < 32; k++) {
        __m256 wv[4];
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++) wv[g] = _mm256_loadu_ps(w + k * 32 + 8 * g);
        #pragma GCC unroll 2
        for (int r = 0; r < ROWS; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            #pragma GCC unroll 4
            for (int g = 0; g < 4; g++) a[r][g] = _mm256_fmadd_ps(xv, wv[g], a[r][g]);
        }
    }
    #pragma GCC unroll 2
    for (int r = 0; r < ROWS; r++)
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++) acc[r * 4 + g] = a[r][g];
}

/* 3 or more rows: each block of the 32 columns widened once into the stack panel w, which
   the rows take two at a time */
AVX2_TARGET INLINE void qs_panel_rows(const linear_quant_job *j, int64_t n0, int64_t cols,
                                      float *w, __m256 *acc, const int BITS) {
    const int64_t M = j->M;
    for (int64_t i = 0; i < M * 4; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < j->KB; kb++) {
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) qs_widen8(j, n0 + 8 * c, cols - 8 * c, kb, w + 8 * c, BITS);
        const float *x = j->xf + kb * 32;
        int64_t r = 0;
        for (; r + 2 <= M; r += 2) qs_rows(x + r * j->ldx, j->ldx, w, acc + r * 4, 2);
        if (r < M) qs_rows(x + r * j->ldx, j->ldx, w, acc + r * 4, 1);
    }
}

/* the groups of 32 columns g_begin .. g_end, for all M (< Q_PANEL_ROWS) rows */
AVX2_TARGET INLINE void qs_groups(const linear_quant_job *j, int64_t g_begin, int64_t g_end,
                                  const int BITS) {
    float w[32 * 32] __attribute__((aligned(32)));
    __m256 acc[Q_PANEL_ROWS * 4];
    const int64_t M = j->M;
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t n0 = 32 * g, cols = j->N - n0 < 32 ? j->N - n0 : 32;
        if (M == 1) qs_direct(j, n0, cols, acc, BITS, 1);
        else if (M == 2) qs_direct(j, n0, cols, acc, BITS, 2);
        else qs_panel_rows(j, n0, cols, w, acc, BITS);
        for (int64_t r = 0; r < M; r++)
            for (int c = 0; c < 4; c++) {
                if (8 * c >= cols) break;
                const __m256 b = j->bias ? load8n(j->bias + n0 + 8 * c, cols - 8 * c, 0)
                                         : _mm256_setzero_ps();
                store8n((char *)j->y + ((r * j->ldy + n0 + 8 * c) << (j->dtype ? 1 : 2)),
                        _mm256_add_ps(acc[r * 4 + c], b), cols - 8 * c, j->dtype);
            }
    }
}

/* Below Q_PANEL_ROWS rows: the groups of 32 columns g_begin .. g_end */
AVX2_TARGET static void linear_quant_small(void *ctx, int64_t g_begin, int64_t g_end) {
    const linear_quant_job *j = ctx;
    if (j->bits == 4) qs_groups(j, g_begin, g_end, 4); /* a constant width: no branch per block */
    else qs_groups(j, g_begin, g_end, 8);
}

/* -- x rounded to int8 per block (round_x) --------------------------------------------------- */

/* Each block of 32 values of each row of x (fp32) rounded to int8: dx = max|x| / 127, q =
   nearest-even(x * (127 / max|x|)), clamped to +-127 (all zero when max|x| is 0); xd = dx,
   xs = dx * sum(q) and xi = sum(q), per row and block. The reference (sgl.kernels.ops) computes the same
   float32 operations in the same order, so the integers agree exactly. */
AVX2_TARGET void sgl_round_x_blocks(const float *xf, int64_t ldx, int64_t M, int64_t KB,
                                    int8_t *xq, float *xd, float *xs, int32_t *xi) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t r = 0; r < M; r++)
        for (int64_t kb = 0; kb < KB; kb++) {
            const float *v = xf + r * ldx + kb * 32;
            __m256 mx = _mm256_and_ps(_mm256_loadu_ps(v), abs_mask);
            for (int i = 1; i < 4; i++)
                mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(v + 8 * i), abs_mask));
            const float amax = hmax8(mx);
            int8_t *q = xq + r * KB * 32 + kb * 32;
            int sum = 0;
            if (amax > 0.0f) {
                const __m256 id = _mm256_set1_ps(127.0f / amax);
                __m256i qi[4];
                for (int i = 0; i < 4; i++) {
                    __m256 t = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), id),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)),
                                      _mm256_set1_ps(127.0f));
                    qi[i] = _mm256_cvtps_epi32(t);
                }
                /* the 32 int8 in order: packs interleave the 128-bit lanes (dwords of 4 values:
                   0-3 of qi[0], of qi[1], qi[2], qi[3], then their 4-7), the permute undoes it */
                const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                                         _mm256_packs_epi32(qi[2], qi[3]));
                _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                    bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
                const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                                   _mm256_add_epi32(qi[2], qi[3]));
                __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s),
                                          _mm256_extracti128_si256(s, 1));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
                sum = _mm_cvtsi128_si32(h);
            } else {
                memset(q, 0, 32);
            }
            xd[r * KB + kb] = amax / 127.0f;
            xs[r * KB + kb] = (amax / 127.0f) * (float)sum;
            xi[r * KB + kb] = sum;
        }
}

/* dst[r * ld + c] = rows[c][off + r] for r, c < 8: an 8 x 8 transpose */
AVX2_TARGET INLINE void transpose8_store(float rows[8][32], int64_t off, float *dst, int64_t ld) {
    __m256 a[8], t[8];
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(rows[c] + off);
    #pragma GCC unroll 4
    for (int c = 0; c < 8; c += 2) {
        t[c] = _mm256_unpacklo_ps(a[c], a[c + 1]);
        t[c + 1] = _mm256_unpackhi_ps(a[c], a[c + 1]);
    }
    #pragma GCC unroll 2
    for (int c = 0; c < 8; c += 4) {
        a[c] = _mm256_shuffle_ps(t[c], t[c + 2], 0x44);
        a[c + 1] = _mm256_shuffle_ps(t[c], t[c + 2], 0xEE);
        a[c + 2] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0x44);
        a[c + 3] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0xEE);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(dst + r * ld, _mm256_permute2f128_ps(a[r], a[r + 4], 0x20));
        _mm256_storeu_ps(dst + (r + 4) * ld, _mm256_permute2f128_ps(a[r], a[r + 4], 0x31));
    }
}

/* Many rows: 32 columns at a time widened into one panel of sgl_linear_f32's layout ([K][32]) in
   this thread's scratch, then multiplied by the float32 matmul's 6 x 16 tiles, which broadcast x
   from L1 instead of reading a vector of x per product */
AVX2_TARGET static void linear_quant_panels(void *ctx, int64_t np_begin, int64_t np_end) {
    const linear_quant_job *j = ctx;
    const int64_t K = j->KB * 32, qb = j->bits == 4 ? 16 : 32, M = j->M;
    float *panel = sgl_scratch(0, (size_t)(K * 32 + (j->dtype ? M * 32 : 0)) * 4);
    if (!panel) {
        linear_quant_small(ctx, np_begin, np_end); /* no memory: the same sums, a block at a time */
        return;
    }
    float *yt = panel + K * 32; /* the panel's fp32 results when y is bfloat16 */
    for (int64_t np = np_begin; np < np_end; np++) {
        const int64_t n0 = 32 * np, cols = j->N - n0 < 32 ? j->N - n0 : 32;
        for (int64_t c0 = 0; c0 < 32; c0 += 8) /* 8 columns: each block widened, transposed */
            for (int64_t kb = 0; kb < j->KB; kb++) {
                float vals[8][32];
                for (int64_t c = 0; c < 8; c++) {
                    __m256 w[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                                   _mm256_setzero_ps()}; /* past the last column: zeros */
                    const int64_t at = (n0 + c0 + c) * j->KB + kb;
                    if (c0 + c < cols) {
                        if (j->bits == 4) dequant_block(j->qw + at * qb, j->sc + at * 2, 4, w);
                        else dequant_block(j->qw + at * qb, j->sc + at * 2, 8, w);
                    }
                    #pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) _mm256_storeu_ps(vals[c] + 8 * i, w[i]);
                }
                for (int i = 0; i < 4; i++)
                    transpose8_store(vals, 8 * i, panel + (kb * 32 + 8 * i) * 32 + c0, 32);
            }
        const float *b = j->bias ? j->bias + n0 : NULL;
        if (!j->dtype) {
            sgl_f32_panel_avx2(j->xf, j->ldx, panel, (float *)j->y + n0, j->ldy, M, cols, K, b);
            continue;
        }
        sgl_f32_panel_avx2(j->xf, j->ldx, panel, yt, 32, M, cols, K, b);
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < cols; c++)
                ((uint16_t *)j->y)[r * j->ldy + n0 + c] = quant_bf16_of(yt[r * 32 + c]);
    }
}

/* x [M, K] (row stride ldx; dtype 1: bfloat16, 0: float32), qw and sc the q4 (bits 4) or q8
   (bits 8) weight [N, K/32, 16 or 32] and its float16 (d, m) [N, K/32, 2], y [M, N] (row stride
   ldy, x's dtype), bias float32 [N] or NULL; K a multiple of 32. round_x: x is first rounded
   per block to int8 (sgl_round_x_blocks) and the products are integer ones, at any M. -1: no
   memory for x's copies; -2: bits is neither 4 nor 8. */
AVX2_TARGET int sgl_linear_quant_avx2(const void *x, int64_t ldx, const uint8_t *qw,
                                      const uint16_t *sc, void *y, int64_t ldy, int64_t M,
                                      int64_t N, int64_t K, const float *bias, int dtype,
                                      int bits, int round_x) {
    if (bits != 4 && bits != 8) return -2;
    const float *xf = x;
    const int64_t KB = K / 32;
    /* fp32 copy of a bfloat16 x, then (round_x) the int8 blocks and their dx, dx * sum */
    const size_t copy_bytes = dtype ? (size_t)(M * K) * 4 : 0;
    const size_t round_bytes = round_x ? (size_t)(M * K) + (size_t)(3 * M * KB) * 4 + 64 : 0;
    char *buf = (dtype || round_x) ? sgl_scratch(1, copy_bytes + round_bytes) : NULL;
    if ((dtype || round_x) && !buf) return -1;
    if (dtype) {
        float *copy = (float *)buf;
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k += 8)
                _mm256_storeu_ps(copy + r * K + k, load8((const uint16_t *)x + r * ldx + k, 1));
        xf = copy;
        ldx = K;
    }
    if (round_x) {
        float *xd = (float *)(buf + copy_bytes), *xs = xd + M * KB;
        int32_t *xi = (int32_t *)(xs + M * KB);
        int8_t *xq = (int8_t *)(xi + M * KB);
        sgl_round_x_blocks(xf, ldx, M, KB, xq, xd, xs, xi);
        quant_i8_job i8 = {qw, sc, y, bias, ldy, M, N, KB, dtype, bits, xq, xd, xs, xi};
        const int64_t octets = (N + 7) / 8;
        sgl_parallel_for(i8_octets, &i8, octets, chunk_of(octets));
        return 0;
    }
    linear_quant_job job = {xf, qw, sc, y, bias, ldx, ldy, M, N, KB, dtype, bits};
    if (M >= Q_PANEL_ROWS) {
        const int64_t panels = (N + 31) / 32;
        sgl_parallel_for(linear_quant_panels, &job, panels, chunk_of(panels));
    } else {
        const int64_t groups = (N + 31) / 32;
        sgl_parallel_for(linear_quant_small, &job, groups, chunk_of(groups));
    }
    return 0;
}

/* -- the embedding lookup ------------------------------------------------------------------ */

#define EMBED_PARALLEL_VALUES (1 << 16) /* from this many values out: the rows over the threads */

typedef struct {
    const uint8_t *qw;
    const uint16_t *sc;
    const int64_t *ids;
    void *out;
    int64_t o_stride, KB;
    int dtype, bits, x16; /* x16: the table in the x16 layout (sc unused) */
} embedding_quant_job;

/* out row t = row ids[t] of the table, block by block */
AVX2_TARGET INLINE void embed_row(const embedding_quant_job *j, int64_t t, const int BITS) {
    const int64_t qb = BITS == 4 ? 16 : 32, KB = j->KB, es = j->dtype ? 2 : 4;
    const uint8_t *q = j->qw + j->ids[t] * KB * qb;
    const uint16_t *s = j->sc + j->ids[t] * KB * 2;
    char *row = (char *)j->out + t * j->o_stride * es;
    /* in the x16 layout: group id / 16, lane id % 16 of each block's vectors and scales */
    const int64_t group = j->ids[t] / 16, lane = j->ids[t] % 16, bb = 16 * qb + 64;
    for (int64_t kb = 0; kb < KB; kb++) {
        __m256 w[4];
        if (j->x16) {
            const uint8_t *blk = j->qw + (group * KB + kb) * bb;
            uint8_t ints[32];
            uint16_t ds[2];
            for (int64_t i = 0; i < qb / 4; i++) memcpy(ints + 4 * i, blk + 64 * i + 4 * lane, 4);
            if (BITS == 8)
                for (int i = 0; i < 32; i++) ints[i] ^= 0x80; /* stored plus 128 */
            memcpy(ds, blk + 16 * qb + 2 * lane, 2);
            memcpy(ds + 1, blk + 16 * qb + 32 + 2 * lane, 2);
            dequant_block(ints, ds, BITS, w);
        } else {
            dequant_block(q + kb * qb, s + kb * 2, BITS, w);
        }
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) store8(row + (kb * 32 + 8 * i) * es, w[i], j->dtype);
    }
}

/* out row t = row ids[t] of a q6x16 table (sgl/kernels/quant.py): each value d s (q - 32),
   exact in float32 (an 11-bit d times an integer of at most 13 bits) */
AVX2_TARGET INLINE void embed_row_q6x16(const embedding_quant_job *j, int64_t t) {
    const int64_t KB = j->KB, es = j->dtype ? 2 : 4, bb = 6 * 64 + 64;
    const int64_t group = j->ids[t] / 16, lane = j->ids[t] % 16;
    char *row = (char *)j->out + t * j->o_stride * es;
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint8_t *blk = j->qw + (group * KB + kb) * bb;
        uint8_t low[16], high[8];
        for (int i = 0; i < 4; i++) memcpy(low + 4 * i, blk + 64 * i + 4 * lane, 4);
        for (int p = 0; p < 2; p++) memcpy(high + 4 * p, blk + 256 + 64 * p + 4 * lane, 4);
        const int s[2] = {(int8_t)blk[384 + lane], (int8_t)blk[400 + lane]};
        uint16_t dh;
        memcpy(&dh, blk + 416 + 2 * lane, 2);
        const float d = _cvtsh_ss(dh);
        float v[32];
        for (int k = 0; k < 32; k++) { /* value k: nibble byte k % 16, high byte 4 (k / 16) + k % 4,
                                          bits 2 ((k % 16) / 4) */
            const int nib = k < 16 ? low[k] & 0x0F : low[k - 16] >> 4;
            const int hi = (high[4 * (k / 16) + k % 4] >> (2 * ((k % 16) / 4))) & 3;
            v[k] = d * (float)(s[k / 16] * ((nib | hi << 4) - 32));
        }
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            store8(row + (kb * 32 + 8 * i) * es, _mm256_loadu_ps(v + 8 * i), j->dtype);
    }
}

AVX2_TARGET static void embedding_quant_rows(void *ctx, int64_t t_begin, int64_t t_end) {
    const embedding_quant_job *j = ctx;
    for (int64_t t = t_begin; t < t_end; t++) {
        if (j->bits == 4) embed_row(j, t, 4); /* a constant width: no branch per block */
        else if (j->bits == 6) embed_row_q6x16(j, t);
        else embed_row(j, t, 8);
    }
}

/* Row t of out [T, K] (row stride o_stride; dtype 1: bfloat16, 0: float32) = row ids[t] of the
   q4 (bits 4) or q8 (bits 8) table qw [vocab, K/32, 16 or 32] with its float16 (d, m) sc [vocab,
   K/32, 2], each value d q + m; K a multiple of 32. Large lookups share the rows out over the
   pool's threads. x16: qw is the table in the x16 layout (sgl/kernels/quant.py; vocab a multiple
   of 16, sc unused; bits may be 6 too, q6x16). -1 (nothing written) when an id is outside [0,
   vocab); -2: bits is neither 4 nor 8 (nor 6 in the x16 layout). */
AVX2_TARGET int sgl_embedding_quant(const uint8_t *qw, const uint16_t *sc, int64_t vocab,
                                    int64_t K, const int64_t *ids, int64_t T, void *out,
                                    int64_t o_stride, int dtype, int bits, int x16) {
    if (bits != 4 && bits != 8 && !(bits == 6 && x16)) return -2;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return -1;
    embedding_quant_job job = {qw, sc, ids, out, o_stride, K / 32, dtype, bits, x16};
    if (T * K >= EMBED_PARALLEL_VALUES) sgl_parallel_for(embedding_quant_rows, &job, T,
                                                         sgl_row_chunk(T));
    else embedding_quant_rows(&job, 0, T);
    return 0;
}

#endif
