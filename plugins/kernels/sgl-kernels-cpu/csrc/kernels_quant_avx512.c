/* The quantized matmuls (sgl::linear_q4, sgl::linear_q8) on AVX-512, for the amx, avx512_bf16
 * and avx512 levels, below Q512_TILE_ROWS rows: the decode shapes, where the AVX2 kernel's
 * widening of each block (4 vectors of 8) is the bulk of the work on a CPU with 16 lanes.
 *
 * The arguments, layouts and results are those of sgl_linear_quant_avx2 (kernels_quant_avx2.c):
 * y[M, N] = x[M, K] . W^T (+ bias), W = d q + m per block of 32 values along K, x read as fp32
 * (a bfloat16 x is widened once into scratch), float32 sums rounded once to x's dtype. Each
 * block is widened to two vectors of 16 (values 0-15, 16-31: a q4 block's low and high
 * nibbles) once for the tile's rows; 1-4 rows keep one chain of sums per vector. From
 * Q512_TILE_ROWS rows, and with round_x, the AVX2 kernel runs (its widened panels and integer
 * products).
 */
#if defined(SGL_EMULATE_ISA)
#include "isa_emulation.h"

#define QUANT512_TARGET
#elif defined(__x86_64__)
#include <immintrin.h>

#define QUANT512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
#endif

#include "jobs.h"
#include "kernels.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)

#define Q512_TILE_ROWS 12 /* from this many rows: the AVX2 kernel's panels */
#define Q512_INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *xf; /* x in fp32 */
    const uint8_t *qw;
    const uint16_t *sc;
    void *y;
    const float *bias;
    int64_t ldx, ldy, M, N, KB;
    int dtype, bits;
} q512_job;

/* the nearest bfloat16 of v (ties to even; a NaN stays a NaN) */
static inline uint16_t q512_bf16_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits | 0x400000u) >> 16);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* one block's 32 values, d q + m, as w[0] (values 0-15) and w[1] (values 16-31) */
QUANT512_TARGET Q512_INLINE void q512_dequant(const uint8_t *q, const uint16_t *s, const int BITS,
                                              __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(s[0]));
    const __m512 m = _mm512_set1_ps(_cvtsh_ss(s[1]));
    __m512i v[2];
    if (BITS == 4) { /* byte j: value j (low nibble) and value j + 16 (high nibble) */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        v[0] = _mm512_and_si512(b, _mm512_set1_epi32(0x0F));
        v[1] = _mm512_srli_epi32(b, 4);
    } else {
        v[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
        v[1] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[0]), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[1]), d, m);
}

/* y[r0 .. r0 + ROWS, n]: the column's blocks widened once for all the rows; up to 4 rows keep
   a chain of sums per half block, so that a block's two FMAs do not wait on each other */
QUANT512_TARGET Q512_INLINE void q512_tile(const q512_job *j, int64_t r0, int64_t n,
                                           const int BITS, const int ROWS) {
    const int split = ROWS <= 4 ? 2 : 1;
    __m512 acc[8][2];
    const int64_t KB = j->KB, qb = BITS == 4 ? 16 : 32, ldx = j->ldx;
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
        acc[r][0] = _mm512_setzero_ps();
        acc[r][1] = _mm512_setzero_ps();
    }
    const float *x = j->xf + r0 * ldx;
    const uint8_t *q = j->qw + n * KB * qb;
    const uint16_t *sc = j->sc + n * KB * 2;
    for (int64_t kb = 0; kb < KB; kb++) {
        __m512 w[2];
        q512_dequant(q + kb * qb, sc + kb * 2, BITS, w);
        #pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++)
            #pragma GCC unroll 2
            for (int i = 0; i < 2; i++)
                acc[r][i % split] = _mm512_fmadd_ps(
                    w[i], _mm512_loadu_ps(x + r * ldx + kb * 32 + 16 * i), acc[r][i % split]);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
        const __m512 total = split == 2 ? _mm512_add_ps(acc[r][0], acc[r][1]) : acc[r][0];
        const float v = _mm512_reduce_add_ps(total) + (j->bias ? j->bias[n] : 0.0f);
        const int64_t at = (r0 + r) * j->ldy + n;
        if (j->dtype) ((uint16_t *)j->y)[at] = q512_bf16_of(v);
        else ((float *)j->y)[at] = v;
    }
}

/* y[:, n] in tiles of up to 8 rows (constant tile shapes keep the sums in registers) */
QUANT512_TARGET Q512_INLINE void q512_column(const q512_job *j, int64_t n, const int BITS) {
    int64_t r = 0;
    for (; j->M - r >= 8; r += 8) q512_tile(j, r, n, BITS, 8);
    switch (j->M - r) {
    case 7: q512_tile(j, r, n, BITS, 7); break;
    case 6: q512_tile(j, r, n, BITS, 6); break;
    case 5: q512_tile(j, r, n, BITS, 5); break;
    case 4: q512_tile(j, r, n, BITS, 4); break;
    case 3: q512_tile(j, r, n, BITS, 3); break;
    case 2: q512_tile(j, r, n, BITS, 2); break;
    case 1: q512_tile(j, r, n, BITS, 1); break;
    default: break;
    }
}

/* the columns of pairs p_begin .. p_end, each in turn */
QUANT512_TARGET static void q512_pairs(void *ctx, int64_t p_begin, int64_t p_end) {
    const q512_job *j = ctx;
    const int64_t n1 = 2 * p_end < j->N ? 2 * p_end : j->N;
    for (int64_t n = 2 * p_begin; n < n1; n++) {
        if (j->bits == 4) q512_column(j, n, 4); /* a constant width: no branch per block */
        else q512_column(j, n, 8);
    }
}

/* The arguments and return codes of sgl_linear_quant_avx2 (kernels_quant_avx2.c). */
QUANT512_TARGET int sgl_linear_quant_avx512(const void *x, int64_t ldx, const uint8_t *qw,
                                            const uint16_t *sc, void *y, int64_t ldy, int64_t M,
                                            int64_t N, int64_t K, const float *bias, int dtype,
                                            int bits, int round_x) {
    if (bits != 4 && bits != 8) return -2;
    if (round_x || M >= Q512_TILE_ROWS)
        return sgl_linear_quant_avx2(x, ldx, qw, sc, y, ldy, M, N, K, bias, dtype, bits,
                                     round_x);
    const float *xf = x;
    if (dtype) { /* bfloat16 x widened once: a bfloat16 is the top half of its float32 */
        float *copy = sgl_scratch(1, (size_t)(M * K) * 4);
        if (!copy) return -1;
        for (int64_t r = 0; r < M; r++) {
            const uint16_t *row = (const uint16_t *)x + r * ldx;
            for (int64_t k = 0; k < K; k += 16) {
                const __m512i h = _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(row + k)));
                _mm512_storeu_ps(copy + r * K + k, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
            }
        }
        xf = copy;
        ldx = K;
    }
    q512_job job = {xf, qw, sc, y, bias, ldx, ldy, M, N, K / 32, dtype, bits};
    const int64_t pairs = (N + 1) / 2;
    sgl_parallel_for(q512_pairs, &job, pairs, chunk_of(pairs));
    return 0;
}

#endif
