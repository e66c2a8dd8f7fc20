/* The int8 matmul of sgl::linear_w8a8 (SGLang's w8a8_int8 scheme) on AVX2, for every level: the
 * rounding of x's rows to int8 that every level shares, and the AVX2 product the AVX-512 levels
 * hand over where the CPU has no AVX512-VNNI.
 *
 * y[M, N] = x[M, K] . W^T (+ bias) with W = sw[n] * w[n, k], w int8 per output channel, and x
 * rounded per row as it arrives: sx = max|x| / 127, q = nearest-even(x * (127 / max|x|)) in
 * float32, clamped to +-127 (all zero for an all-zero row). The products are integers summed
 * exactly in int32, then y = float(sum) * sx * sw[n] (+ bias[n]) in float32, rounded once to x's
 * dtype. Every level computes those same integers and the same float32 operations in the same
 * order, so every level, every batch and every thread count give the same bits, those of the
 * reference (sgl.kernels.ops.linear_w8a8).
 *
 * The weight is packed (sgl.kernels.ops.pack_int8_weight) as [Np/16][Kp/4][16][4] bytes holding
 * w + 128: for each group of 16 output channels and each 4 values along K, the 4 values of each
 * channel side by side, which is the B operand of AMX's int8 tiles and of a 512-bit vpdpbusd
 * with a broadcast dword of x. The stored bytes are unsigned (w + 128), x's are signed, so each
 * sum holds sum(w q) + 128 sum(q); 128 sum(q) is known per row and taken off. N is padded to 16
 * and K to 64 with w = 0; x's rows are padded with zeros to Kp.
 *
 * Here: 1-2 rows by 16 channels at a time, the bytes widened to int16 and multiplied by
 * vpmaddwd (exact; vpmaddubsw would saturate); the channel groups shared out over the threads.
 */
#include "jobs.h"
#include "kernels.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include "vec_avx2.h"

/* Row r of x (dtype 1: bfloat16, 0: float32) rounded to int8 as the header says: xq[r, 0..ldq)
   (zero past K), sx[r], and xs[r] = 128 * sum(q). Rows M .. Mp of xq are zeroed. */
AVX2_TARGET void sgl_w8a8_round_rows(const void *x, int64_t ldx, int dtype, int64_t M,
                                     int64_t Mp, int64_t K, int64_t ldq, int8_t *xq, float *sx,
                                     int32_t *xs) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const int64_t es = dtype ? 2 : 4;
    for (int64_t r = 0; r < M; r++) {
        const char *row = (const char *)x + r * ldx * es;
        __m256 mx = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8(row + k * es, dtype),
                                                                         abs_mask));
        if (k < K) mx = _mm256_max_ps(mx, _mm256_and_ps(load8n(row + k * es, K - k, dtype),
                                                        abs_mask));
        const float amax = hmax8(mx);
        int8_t *q = xq + r * ldq;
        memset(q, 0, (size_t)ldq);
        sx[r] = amax / 127.0f;
        int32_t sum = 0;
        if (amax > 0.0f) {
            const __m256 inv = _mm256_set1_ps(127.0f / amax);
            const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
            __m256i acc = _mm256_setzero_si256();
            for (k = 0; k < K; k += 8) {
                const int64_t n = K - k < 8 ? K - k : 8;
                __m256 t = _mm256_round_ps(_mm256_mul_ps(load8n(row + k * es, n, dtype), inv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
                acc = _mm256_add_epi32(acc, v);
                const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v),
                                                  _mm256_extracti128_si256(v, 1));
                int64_t bytes = _mm_cvtsi128_si64(_mm_packs_epi16(w, w));
                memcpy(q + k, &bytes, (size_t)n);
            }
            const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc),
                                            _mm256_extracti128_si256(acc, 1));
            const __m128i s = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
            sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
        }
        xs[r] = 128 * sum;
    }
    if (Mp > M) memset(xq + M * ldq, 0, (size_t)((Mp - M) * ldq));
}

/* -- the product: 1-2 rows by one group of 16 channels ---------------------------------------- */

/* acc[r][i] lane 2c + h (c < 4): channel 4i + c, the products of its values 4k + 2h, 4k + 2h + 1 */
AVX2_TARGET INLINE void w8_tile_avx2(const w8a8_job *j, int64_t m0, int R, int64_t g) {
    const int64_t Kp = j->Kp;
    const uint8_t *w = j->wp + g * Kp * 16;
    __m256i acc[2][4];
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_si256();
    for (int64_t k4 = 0; k4 < Kp / 4; k4++) {
        __m256i wv[4];
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            wv[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + k4 * 64 + 16 * i)));
        #pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            if (r >= R) break;
            int32_t x4;
            memcpy(&x4, j->xq + (m0 + r) * j->ldq + 4 * k4, 4);
            const __m256i xv = _mm256_cvtepi8_epi16(_mm_set1_epi32(x4));
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(wv[i], xv));
        }
    }
    for (int r = 0; r < R; r++) {
        int32_t lanes[4][8], sums[16];
        for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)lanes[i], acc[r][i]);
        for (int c = 0; c < 16; c++) sums[c] = lanes[c / 4][2 * (c % 4)] + lanes[c / 4][2 * (c % 4) + 1];
        w8a8_store_row(j, m0 + r, g * 16, sums);
    }
}

AVX2_TARGET static void w8a8_groups_avx2(void *ctx, int64_t begin, int64_t end) {
    const w8a8_job *j = ctx;
    for (int64_t g = begin; g < end; g++)
        for (int64_t m0 = 0; m0 < j->M; m0 += 2) w8_tile_avx2(j, m0, j->M - m0 >= 2 ? 2 : 1, g);
}

AVX2_TARGET int sgl_linear_w8a8_avx2(const void *x, int64_t ldx, const uint8_t *wp,
                                     const float *sw, void *y, int64_t ldy, int64_t M, int64_t N,
                                     int64_t K, const float *bias, int dtype) {
    w8a8_job job;
    const int rc = w8a8_setup(&job, x, ldx, wp, sw, y, ldy, M, N, K, bias, dtype);
    if (rc) return rc;
    const int64_t groups = (N + 15) / 16;
    sgl_parallel_for(w8a8_groups_avx2, &job, groups, chunk_of(groups));
    return 0;
}

#endif
