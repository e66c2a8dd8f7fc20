/* The integer path of the quantized matmuls (round_x): x rounded per block to int8
 * (sgl_round_x_blocks), each block's products summed exactly in int32, then per row and column
 * the one float32 sequence every round_x kernel follows (the 16-column tiles of
 * kernels_quant_avx512.c too), block by block in K's order from acc = 0:
 *
 *     acc = fma(float(sum), d * dx, acc);  acc = fma(m, dx * sum(q), acc)
 *
 * then y = acc (+ bias), rounded once to x's dtype. The sums are exact and x's rounding is a
 * row's own, so a row's result is the same bits at any number of rows, in any tile, on any
 * thread count: rounded activations keep a request's tokens independent of its batch and of
 * the prefix cache (prefill rounds as decode does).
 *
 * Included by kernels_quant_avx2.c (ROUND_X_VNNI 0: vpmaddubsw + vpmaddwd) and
 * kernels_quant_avx512.c (ROUND_X_VNNI 1: 256-bit vpdpbusd, AVX512-VNNI), each of which defines
 * ROUND_X_TARGET, the target attribute of these functions, and gets its own static copies.
 * Tiles of up to I8_TILE_ROWS rows x 8 columns: per block two columns share a vector (one in
 * each 128-bit half, x's half-block broadcast to both), their products summed by fours into
 * int32 lanes, then two rounds of horizontal adds give the 8 columns' sums in one vector
 * (exact), and the float sequence runs with the columns in the lanes. The groups of 8 columns
 * are shared out over the pool's threads. */
#ifndef SGL_QUANT_ROUND_X_H
#define SGL_QUANT_ROUND_X_H

#include <stdint.h>
#include <string.h>

#define I8_INLINE static inline __attribute__((always_inline))
/* each column's blocks this far ahead are asked for: 8 columns' 32 blocks are 4 KiB (q4) or
   8 KiB (q8) in flight per thread, more than a core's bandwidth times memory latency */
#define I8_AHEAD_BLOCKS 32
/* rows per tile: 8 where AVX-512 gives 32 vector registers, 4 with AVX2's 16 */
#if ROUND_X_VNNI
#define I8_TILE_ROWS 8
#else
#define I8_TILE_ROWS 4
#endif

typedef struct {
    const uint8_t *qw;
    const uint16_t *sc;
    void *y; /* x's dtype */
    const float *bias;
    int64_t ldy, M, N, KB;
    int dtype, bits;
    const int8_t *xq;     /* x rounded per block: int8 [M, K] */
    const float *xd, *xs; /* per row and block: dx, dx * sum(q) */
    const int32_t *xi;    /* per row and block: sum(q) */
} quant_i8_job;

/* the nearest bfloat16 of v (ties to even; a NaN stays a NaN) */
static inline uint16_t quant_bf16_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits | 0x400000u) >> 16);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* values 0-15 (half 0) or 16-31 (half 1) of the blocks of two columns, q0 and q1, as bytes:
   the first column's in the low 128 bits, the second's in the high (q4: 0..15, q8: signed) */
ROUND_X_TARGET I8_INLINE __m256i i8_pair_ints(const uint8_t *q0, const uint8_t *q1, const int half,
                                             const int BITS) {
    if (BITS == 8)
        return _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(q0 + 16 * half))),
            _mm_loadu_si128((const __m128i *)(q1 + 16 * half)), 1);
    /* byte j: value j (low nibble) and j + 16 (high) */
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q0)),
        _mm_loadu_si128((const __m128i *)q1), 1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    return half ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), low) : _mm256_and_si256(raw, low);
}

/* the integers as the unsigned operand of the products: q4's 0..15 as they are; q8: |w| (x then
   takes w's sign) without VNNI, w + 128 with it (128 sum(q) taken off after) */
ROUND_X_TARGET I8_INLINE __m256i i8_unsigned(__m256i w, const int BITS) {
    if (BITS == 4) return w;
#if ROUND_X_VNNI
    return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
#else
    return _mm256_sign_epi8(w, w);
#endif
}

/* two columns' exact block products with the row (x0: its values 0-15 in both 128-bit halves,
   x1: 16-31): lanes 0-3 the first column's, summed by fours, lanes 4-7 the second's. u0, u1:
   i8_unsigned of the halves' integers w0, w1 */
ROUND_X_TARGET I8_INLINE __m256i i8_pair_dot(const __m256i u[2], const __m256i w[2], __m256i x0,
                                            __m256i x1, const int BITS) {
#if ROUND_X_VNNI /* vpdpbusd: byte products summed by fours into int32 */
    (void)w;
    (void)BITS;
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u[0], x0), u[1], x1);
#else /* vpmaddubsw (pairs into int16; |w| <= 128, |x| <= 127: no saturation), vpmaddwd */
    const __m256i ones = _mm256_set1_epi16(1);
    if (BITS == 4) /* 4 products of at most 15 * 127 per int16: the halves add in int16 */
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u[0], x0),
                                                  _mm256_maddubs_epi16(u[1], x1)), ones);
    return _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(u[0], _mm256_sign_epi8(x0, w[0])), ones),
        _mm256_madd_epi16(_mm256_maddubs_epi16(u[1], _mm256_sign_epi8(x1, w[1])), ones));
#endif
}

/* the block sums of 8 columns from the pairs' products v[p] (columns 2p, 2p + 1): lane l holds
   column I8_LANE_COLUMN[l] */
static const int I8_LANE_COLUMN[8] = {0, 2, 4, 6, 1, 3, 5, 7};
ROUND_X_TARGET I8_INLINE __m256i i8_sum_pairs(const __m256i v[4]) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

/* d and m of blocks kb .. kb + n (n <= 8) of the 8 columns, as float32: d[b * 8 + c] */
ROUND_X_TARGET I8_INLINE void i8_scales_cols8(const uint16_t *const sc[8], int64_t kb, int64_t n,
                                             float *d, float *m) {
    if (n < 8) {
        for (int64_t b = 0; b < n; b++)
            for (int c = 0; c < 8; c++) {
                d[b * 8 + c] = _cvtsh_ss(sc[c][(kb + b) * 2]);
                m[b * 8 + c] = _cvtsh_ss(sc[c][(kb + b) * 2 + 1]);
            }
        return;
    }
    /* each column's 8 (d, m) pairs as dwords, 8 x 8 transposed to a block's 8 columns */
    __m256i r[8], t[8];
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_si256((const __m256i *)(sc[c] + kb * 2));
    #pragma GCC unroll 4
    for (int c = 0; c < 8; c += 2) {
        t[c] = _mm256_unpacklo_epi32(r[c], r[c + 1]);
        t[c + 1] = _mm256_unpackhi_epi32(r[c], r[c + 1]);
    }
    #pragma GCC unroll 2
    for (int c = 0; c < 8; c += 4) {
        r[c] = _mm256_unpacklo_epi64(t[c], t[c + 2]);
        r[c + 1] = _mm256_unpackhi_epi64(t[c], t[c + 2]);
        r[c + 2] = _mm256_unpacklo_epi64(t[c + 1], t[c + 3]);
        r[c + 3] = _mm256_unpackhi_epi64(t[c + 1], t[c + 3]);
    }
    /* r[i] (i < 4): lane l < 4 is column l's block i (128-bit lane 0) or 4 + i (lane 1);
       r[4 + i] the same for columns 4-7 */
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i pairs = h ? _mm256_permute2x128_si256(r[i], r[4 + i], 0x31)
                                    : _mm256_permute2x128_si256(r[i], r[4 + i], 0x20);
            /* the low words (d) to the low 64 bits of each 128-bit lane, the high (m) above */
            const __m256i split = _mm256_shuffle_epi8(pairs, _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
            const __m256i ordered = _mm256_permute4x64_epi64(split, 0xD8);
            const int b = i + 4 * h;
            _mm256_storeu_ps(d + b * 8, _mm256_cvtph_ps(_mm256_castsi256_si128(ordered)));
            _mm256_storeu_ps(m + b * 8, _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1)));
        }
}

/* y[r0 .. r0 + ROWS, n .. n + cols] (cols <= 8) from the rounded x, in the float sequence of
   the header comment, the 8 columns in the lanes (in I8_LANE_COLUMN's order) */
ROUND_X_TARGET I8_INLINE void i8_tile(const quant_i8_job *j, int64_t r0, int64_t n, int64_t cols,
                                      const int BITS, const int ROWS) {
    const int64_t KB = j->KB, qb = BITS == 4 ? 16 : 32, K = KB * 32;
    const uint8_t *q[8];
    const uint16_t *sc[8]; /* in the lanes' order */
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++) { /* columns past the last repeat it, and are not stored */
        const int64_t col = n + (c < cols ? c : cols - 1);
        q[c] = j->qw + col * KB * qb;
        const int64_t lane_col = n + (I8_LANE_COLUMN[c] < cols ? I8_LANE_COLUMN[c] : cols - 1);
        sc[c] = j->sc + lane_col * KB * 2;
    }
    __m256 acc[I8_TILE_ROWS];
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    const int8_t *xq = j->xq + r0 * K;
    const float *xd = j->xd + r0 * KB, *xs = j->xs + r0 * KB;
    const int32_t *xi = j->xi + r0 * KB;
    for (int64_t kb0 = 0; kb0 < KB; kb0 += 8) {
        const int64_t nb = KB - kb0 < 8 ? KB - kb0 : 8;
        float ds[64] __attribute__((aligned(32))), ms[64] __attribute__((aligned(32)));
        i8_scales_cols8(sc, kb0, nb, ds, ms);
        /* the columns are read across their rows, which the hardware's prefetchers do not
           follow: each column's blocks I8_AHEAD_BLOCKS ahead are asked for, and past its end
           the same blocks of the next 8 columns (the next octet, laid out after these) */
        const int64_t ahead = kb0 + I8_AHEAD_BLOCKS;
        const int64_t skip = ahead < KB ? ahead : ahead + 7 * KB; /* blocks from q[c] */
        #pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const char *next = (const char *)(q[c] + skip * qb);
            for (int l = 0; l < 8 * qb; l += 64) _mm_prefetch(next + l, _MM_HINT_T0);
            _mm_prefetch((const char *)(sc[c] + skip * 2), _MM_HINT_T0);
        }
        for (int64_t b = 0; b < nb; b++) {
            const int64_t kb = kb0 + b;
            __m256i w[4][2], u[4][2];
            #pragma GCC unroll 4
            for (int p = 0; p < 4; p++)
                #pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    w[p][h] = i8_pair_ints(q[2 * p] + kb * qb, q[2 * p + 1] + kb * qb, h, BITS);
                    u[p][h] = i8_unsigned(w[p][h], BITS);
                }
            const __m256 d = _mm256_load_ps(ds + b * 8), m = _mm256_load_ps(ms + b * 8);
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const int8_t *xb = xq + r * K + kb * 32;
                const __m256i x0 = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)xb));
                const __m256i x1 = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(xb + 16)));
                __m256i dots[4];
                #pragma GCC unroll 4
                for (int p = 0; p < 4; p++) dots[p] = i8_pair_dot(u[p], w[p], x0, x1, BITS);
                __m256i sum = i8_sum_pairs(dots);
#if ROUND_X_VNNI
                if (BITS == 8) /* the 128 added to every weight */
                    sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * xi[r * KB + kb]));
#endif
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[r * KB + kb]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * KB + kb]), acc[r]);
            }
        }
    }
    (void)xi;
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
        float v[8];
        _mm256_storeu_ps(v, acc[r]);
        for (int l = 0; l < 8; l++) {
            const int64_t c = I8_LANE_COLUMN[l];
            if (c >= cols) continue;
            const float out = j->bias ? v[l] + j->bias[n + c] : v[l];
            const int64_t at = (r0 + r) * j->ldy + n + c;
            if (j->dtype) ((uint16_t *)j->y)[at] = quant_bf16_of(out);
            else ((float *)j->y)[at] = out;
        }
    }
}

/* y[:, n .. n + cols] (cols 8, or the last 1-7): tiles of up to I8_TILE_ROWS rows */
ROUND_X_TARGET I8_INLINE void i8_columns(const quant_i8_job *j, int64_t n, int64_t cols,
                                         const int BITS) {
    int64_t r = 0;
    for (; j->M - r >= I8_TILE_ROWS; r += I8_TILE_ROWS) i8_tile(j, r, n, cols, BITS, I8_TILE_ROWS);
    switch (j->M - r) {
#if I8_TILE_ROWS > 4
    case 7: i8_tile(j, r, n, cols, BITS, 7); break;
    case 6: i8_tile(j, r, n, cols, BITS, 6); break;
    case 5: i8_tile(j, r, n, cols, BITS, 5); break;
    case 4: i8_tile(j, r, n, cols, BITS, 4); break;
#endif
    case 3: i8_tile(j, r, n, cols, BITS, 3); break;
    case 2: i8_tile(j, r, n, cols, BITS, 2); break;
    case 1: i8_tile(j, r, n, cols, BITS, 1); break;
    default: break;
    }
}

/* the groups of 8 columns g_begin .. g_end */
ROUND_X_TARGET static void i8_octets(void *ctx, int64_t g_begin, int64_t g_end) {
    const quant_i8_job *j = ctx;
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t n = 8 * g, cols = j->N - n < 8 ? j->N - n : 8;
        if (j->bits == 4) i8_columns(j, n, cols, 4);
        else i8_columns(j, n, cols, 8);
    }
}

#endif
