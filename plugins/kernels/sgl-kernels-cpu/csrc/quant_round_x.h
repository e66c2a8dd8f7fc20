/* The integer path of the quantized matmuls (round_x): x rounded per block to int8
 * (sgl_round_x_blocks), each block's products exact in int32, scaled by d * dx in float32, plus
 * m * dx * sum(q). Included by kernels_quant_avx2.c (ROUND_X_VNNI 0: vpmaddubsw + vpmaddwd) and
 * kernels_quant_avx512.c (ROUND_X_VNNI 1: one vpdpbusd, AVX512-VNNI on 256-bit vectors), each
 * of which defines ROUND_X_TARGET, the target attribute of these functions, and gets its own
 * static copies. The column groups of 4 (i8_quads) are shared out over the pool's threads:
 * 1-2 rows take the 4 columns side by side, 3-4 rows 2, more rows tiles of up to 8 rows x 1
 * column. */
#ifndef SGL_QUANT_ROUND_X_H
#define SGL_QUANT_ROUND_X_H

#include <stdint.h>
#include <string.h>

#define I8_INLINE static inline __attribute__((always_inline))

typedef struct {
    const uint8_t *qw;
    const uint16_t *sc;
    void *y; /* x's dtype */
    const float *bias;
    int64_t ldy, M, N, KB;
    int dtype, bits;
    const int8_t *xq;     /* x rounded per block: int8 [M, K] */
    const float *xd, *xs; /* per row and block: dx, dx * sum(q) */
} quant_i8_job;

/* the nearest bfloat16 of v (ties to even; a NaN stays a NaN) */
static inline uint16_t quant_bf16_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits | 0x400000u) >> 16);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* the sum of the lanes of v */
ROUND_X_TARGET I8_INLINE float i8_hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* the sums of the lanes of a, b, c and e, in that order */
ROUND_X_TARGET I8_INLINE __m128 i8_hsum4x8(__m256 a, __m256 b, __m256 c, __m256 e) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* the 32 integers of one block as bytes in value order (q4: 0..15, q8: signed) */
ROUND_X_TARGET I8_INLINE __m256i i8_block_ints(const uint8_t *q, const int BITS) {
    if (BITS == 8) return _mm256_loadu_si256((const __m256i *)q);
    const __m128i raw = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

/* the exact integer dot product of one block's weight integers w with x's int8 xv, as 8 lanes:
   the unsigned operand is w (q4's 0..15), or |w| with w's sign moved onto x (q8) */
ROUND_X_TARGET I8_INLINE __m256 i8_block_dot(__m256i w, __m256i xv, const int BITS) {
    if (BITS == 8) {
        xv = _mm256_sign_epi8(xv, w);
        w = _mm256_sign_epi8(w, w);
    }
#if ROUND_X_VNNI /* one vpdpbusd: 32 byte products summed by fours into int32 */
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv));
#else /* vpmaddubsw (byte products summed by pairs into int16), then vpmaddwd by ones */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv),
                                                _mm256_set1_epi16(1)));
#endif
}

/* d and m of 8 consecutive blocks from their interleaved float16 (d, m) pairs */
ROUND_X_TARGET I8_INLINE void i8_scales8(const uint16_t *sc, __m256 *d, __m256 *m) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));       /* blocks 0-3 */
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 8))); /* blocks 4-7 */
    /* in-lane shuffles give blocks 0 1 4 5 | 2 3 6 7; the 64-bit permute puts them in order */
    *d = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));
    *m = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), 0xD8));
}

/* y[r0 .. r0 + ROWS, n .. n + COLS] from the rounded x: per block the integer products summed
   (exact), scaled by d * dx in float32, and m * dx * sum(q) added.
   The scales of 8 blocks are widened and multiplied at once; the m terms are summed as a vector
   over those blocks into the same sums (only the total of the lanes counts). Several columns
   side by side give few rows independent chains of sums. */
ROUND_X_TARGET I8_INLINE void i8_tile(const quant_i8_job *j, int64_t r0, int64_t n,
                                      const int BITS, const int ROWS, const int COLS) {
    const int64_t KB = j->KB, qb = BITS == 4 ? 16 : 32, K = KB * 32;
    __m256 acc[8][4];
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++)
        #pragma GCC unroll 4
        for (int c = 0; c < COLS; c++) acc[r][c] = _mm256_setzero_ps();
    const int8_t *xq = j->xq + r0 * K;
    const float *xd = j->xd + r0 * KB, *xs = j->xs + r0 * KB;
    const uint8_t *q = j->qw + n * KB * qb;
    const uint16_t *sc = j->sc + n * KB * 2;
    int64_t kb = 0;
    for (; kb + 8 <= KB; kb += 8) {
        float ds[8][4][8]; /* d * dx per row, column and block of the group */
        #pragma GCC unroll 4
        for (int c = 0; c < COLS; c++) {
            __m256 d, m;
            i8_scales8(sc + (c * KB + kb) * 2, &d, &m);
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                _mm256_storeu_ps(ds[r][c], _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * KB + kb)));
                acc[r][c] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + r * KB + kb), acc[r][c]);
            }
        }
        #pragma GCC unroll 8
        for (int b = 0; b < 8; b++) {
            __m256i w[4];
            #pragma GCC unroll 4
            for (int c = 0; c < COLS; c++) w[c] = i8_block_ints(q + (c * KB + kb + b) * qb, BITS);
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K +
                                                                        (kb + b) * 32));
                #pragma GCC unroll 4
                for (int c = 0; c < COLS; c++)
                    acc[r][c] = _mm256_fmadd_ps(i8_block_dot(w[c], xv, BITS),
                                                _mm256_broadcast_ss(&ds[r][c][b]), acc[r][c]);
            }
        }
    }
    for (; kb < KB; kb++) { /* the last blocks, one at a time */
        #pragma GCC unroll 4
        for (int c = 0; c < COLS; c++) {
            const __m256i w = i8_block_ints(q + (c * KB + kb) * qb, BITS);
            const float d = _cvtsh_ss(sc[(c * KB + kb) * 2]);
            const float m = _cvtsh_ss(sc[(c * KB + kb) * 2 + 1]);
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + kb * 32));
                const __m256 sum = _mm256_fmadd_ps(i8_block_dot(w, xv, BITS),
                                                   _mm256_set1_ps(d * xd[r * KB + kb]),
                                                   acc[r][c]);
                /* m * dx * sum(q) in lane 0 */
                acc[r][c] = _mm256_add_ps(sum, _mm256_setr_ps(m * xs[r * KB + kb], 0, 0, 0, 0,
                                                              0, 0, 0));
            }
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
        float v[4];
        if (COLS == 4) {
            _mm_storeu_ps(v, i8_hsum4x8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
        } else {
            #pragma GCC unroll 4
            for (int c = 0; c < COLS; c++) v[c] = i8_hsum8(acc[r][c]);
        }
        #pragma GCC unroll 4
        for (int c = 0; c < COLS; c++) {
            const float out = v[c] + (j->bias ? j->bias[n + c] : 0.0f);
            const int64_t at = (r0 + r) * j->ldy + n + c;
            if (j->dtype) ((uint16_t *)j->y)[at] = quant_bf16_of(out);
            else ((float *)j->y)[at] = out;
        }
    }
}

/* y[:, n .. n + cols] (cols 4, or the last 1-3) from the rounded x: 1-2 rows 4 columns at a
   time, 3-4 rows 2, more rows in tiles of up to 8 rows x 1 column */
ROUND_X_TARGET I8_INLINE void i8_columns(const quant_i8_job *j, int64_t n, int64_t cols,
                                         const int BITS) {
    if (cols == 4 && j->M <= 2) {
        if (j->M == 1) i8_tile(j, 0, n, BITS, 1, 4);
        else i8_tile(j, 0, n, BITS, 2, 4);
        return;
    }
    if (cols == 4 && j->M <= 4) {
        for (int64_t c = 0; c < 4; c += 2) {
            if (j->M == 3) i8_tile(j, 0, n + c, BITS, 3, 2);
            else i8_tile(j, 0, n + c, BITS, 4, 2);
        }
        return;
    }
    for (int64_t c = 0; c < cols; c++) {
        int64_t r = 0;
        for (; j->M - r >= 8; r += 8) i8_tile(j, r, n + c, BITS, 8, 1);
        switch (j->M - r) {
        case 7: i8_tile(j, r, n + c, BITS, 7, 1); break;
        case 6: i8_tile(j, r, n + c, BITS, 6, 1); break;
        case 5: i8_tile(j, r, n + c, BITS, 5, 1); break;
        case 4: i8_tile(j, r, n + c, BITS, 4, 1); break;
        case 3: i8_tile(j, r, n + c, BITS, 3, 1); break;
        case 2: i8_tile(j, r, n + c, BITS, 2, 1); break;
        case 1: i8_tile(j, r, n + c, BITS, 1, 1); break;
        default: break;
        }
    }
}

/* the columns of quads (groups of 4) q_begin .. q_end */
ROUND_X_TARGET static void i8_quads(void *ctx, int64_t q_begin, int64_t q_end) {
    const quant_i8_job *j = ctx;
    for (int64_t g = q_begin; g < q_end; g++) {
        const int64_t n = 4 * g, cols = j->N - n < 4 ? j->N - n : 4;
        if (j->bits == 4) i8_columns(j, n, cols, 4);
        else i8_columns(j, n, cols, 8);
    }
}

#endif
