/* The quantized matmuls (sgl::linear_q4, sgl::linear_q8) at the AVX-512 levels (amx,
 * avx512_bf16, avx512), where they beat the AVX2 kernel (kernels_quant_avx2.c); everything else
 * is handed to it. The arguments, layouts and results are those of sgl_linear_quant_avx2: y[M, N]
 * = x[M, K] . W^T (+ bias), W = d q + m per block of 32 values along K.
 *
 * bfloat16 rows, from Q512_PANEL_ROWS rows (prefill, large batches): 32 columns at a time are
 * widened to d q + m, rounded to bfloat16 and transposed into one panel of the bfloat16 matmul's
 * packed layout in the thread's scratch, which sgl_bf16_panel_avx512 (kernels_avx512.c)
 * multiplies as it multiplies a dense weight: with vdpbf16ps where the level has AVX512-BF16,
 * widened FMAs where not. The widening costs one pass over the blocks per call, shared by all
 * the rows. The weight is rounded to bfloat16 once more than the reference's (which multiplies
 * the float32 d q + m); the product is then the dense bfloat16 product of the rounded weight.
 *
 * With round_x, on a CPU with AVX512-VNNI: x is rounded per block to int8 as the AVX2 kernel
 * rounds it (sgl_round_x_blocks), and each block's products go through one 256-bit vpdpbusd (32
 * products of an unsigned and a signed byte, summed by fours into 8 int32 lanes, exact) where
 * the AVX2 kernel takes vpmaddubsw and vpmaddwd; the rest is the AVX2 kernel's: d * dx per block
 * in float32 plus m * dx * sum(q), its tiles (1-2 rows 4 columns side by side, 3-4 rows 2, more
 * rows 1). 256 bits, not 512: on Zen 4 a 512-bit vpdpbusd runs as two halves, and two blocks per
 * vector measured slower there (their scales must be spread over the lanes).
 *
 * Decode shapes without round_x stay with the AVX2 kernel: a 16-lane version of its tiles, and
 * one multiplying the blocks' integers as bfloat16 with vdpbf16ps, both measured no faster on
 * Zen 4 (docs/benchmarks.md, "Quantized matmuls on AVX-512").
 */
#if defined(SGL_EMULATE_ISA)
#include "isa_emulation.h"

#define VNNI512_TARGET
#define PANEL512_TARGET
#define HAS_VNNI() 1
#elif defined(__x86_64__)
#include <immintrin.h>

#define VNNI512_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define PANEL512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define HAS_VNNI() __builtin_cpu_supports("avx512vnni")
#endif

#include "jobs.h"
#include "kernels.h"

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)

#define Q512_PANEL_ROWS 12 /* from this many bfloat16 rows: the widened bfloat16 panels */
#define Q512_INLINE static inline __attribute__((always_inline))

/* -- bfloat16 rows: widened panels ------------------------------------------------------------ */

typedef struct {
    const uint16_t *x; /* bfloat16 rows (vdpbf16ps) */
    const float *xf;   /* the rows widened to fp32 (without AVX512-BF16) */
    const uint8_t *qw;
    const uint16_t *sc;
    uint16_t *y;
    const float *bias;
    int64_t ldx, ldxf, ldy, M, N, KB;
    int bits, dp;
    atomic_int no_memory; /* a thread found no memory for its panel */
} q512_panel_job;

/* one block's 32 values d q + m rounded to bfloat16 (ties to even; the weights are finite), as
   16 dwords: dword p holds values 2p (low half) and 2p + 1 */
PANEL512_TARGET Q512_INLINE __m512i q512_block_pairs(const uint8_t *q, const uint16_t *s,
                                                    const int BITS) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(s[0])), m = _mm512_set1_ps(_cvtsh_ss(s[1]));
    __m512i v[2]; /* the integers of values 0-15 and 16-31 */
    if (BITS == 4) { /* byte j: value j (low nibble) and value j + 16 (high nibble) */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        v[0] = _mm512_and_si512(b, _mm512_set1_epi32(0x0F));
        v[1] = _mm512_srli_epi32(b, 4);
    } else {
        v[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
        v[1] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
    __m256i h[2];
    #pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {
        const __m512i u = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(v[i]), d, m));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        h[i] = _mm512_cvtepi32_epi16(_mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
}

/* r[i] (16 dwords each) transposed in place: dword j of row i goes to dword i of row j */
PANEL512_TARGET Q512_INLINE void q512_transpose16(__m512i r[16]) {
    __m512i t[16];
    #pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    #pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    #pragma GCC unroll 2
    for (int i = 0; i < 16; i += 8)
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
            t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd);
        }
    #pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
    }
}

/* the column panels np_begin .. np_end: each widened into this thread's scratch in the packed
   bfloat16 layout ([KB][2][16 K pairs][16 columns][2]), then multiplied by all the rows */
PANEL512_TARGET static void q512_panels(void *ctx, int64_t np_begin, int64_t np_end) {
    const q512_panel_job *j = ctx;
    const int64_t KB = j->KB, qb = j->bits == 4 ? 16 : 32;
    uint16_t *panel = sgl_scratch(0, (size_t)(KB * 1024) * 2);
    if (!panel) {
        atomic_store(&((q512_panel_job *)ctx)->no_memory, 1);
        return;
    }
    for (int64_t np = np_begin; np < np_end; np++) {
        const int64_t n0 = 32 * np, cols = j->N - n0 < 32 ? j->N - n0 : 32;
        for (int64_t kb = 0; kb < KB; kb++)
            for (int64_t half = 0; half < 2; half++) {
                __m512i r[16];
                #pragma GCC unroll 16
                for (int c = 0; c < 16; c++) {
                    const int64_t col = 16 * half + c, at = (n0 + col) * KB + kb;
                    if (col >= cols) r[c] = _mm512_setzero_si512(); /* past the last column */
                    else if (j->bits == 4)
                        r[c] = q512_block_pairs(j->qw + at * qb, j->sc + at * 2, 4);
                    else r[c] = q512_block_pairs(j->qw + at * qb, j->sc + at * 2, 8);
                }
                q512_transpose16(r);
                uint16_t *dst = panel + (kb * 2 + half) * 512;
                #pragma GCC unroll 16
                for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(dst + p * 32), r[p]);
            }
        sgl_bf16_panel_avx512(j->x, j->ldx, j->xf, j->ldxf, panel, j->y + n0, j->ldy, j->M, cols,
                              KB * 32, j->bias ? j->bias + n0 : NULL, j->dp);
    }
}

/* bfloat16 x [M, K] (row stride ldx) through widened panels; -1: no memory */
PANEL512_TARGET static int q512_linear_panels(const uint16_t *x, int64_t ldx, const uint8_t *qw,
                                              const uint16_t *sc, uint16_t *y, int64_t ldy,
                                              int64_t M, int64_t N, int64_t K, const float *bias,
                                              int bits, int dp) {
    const int64_t KB = K / 32;
    float *xf = NULL;
    if (!dp) { /* widened once for all the panels: a bfloat16 is the top half of its float32 */
        xf = sgl_scratch(1, (size_t)(M * K) * 4);
        if (!xf) return -1;
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k += 16) {
                const __m512i h = _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(x + r * ldx + k)));
                _mm512_storeu_ps(xf + r * K + k, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
            }
    }
    q512_panel_job job = {x, xf, qw, sc, y, bias, ldx, K, ldy, M, N, KB, bits, dp, 0};
    const int64_t panels = (N + 31) / 32;
    sgl_parallel_for(q512_panels, &job, panels, chunk_of(panels));
    return atomic_load(&job.no_memory) ? -1 : 0;
}

/* -- round_x: integer products with VNNI (quant_round_x.h) ---------------------------------- */

#define ROUND_X_TARGET VNNI512_TARGET
#define ROUND_X_VNNI 1 /* one vpdpbusd per block */
#include "quant_round_x.h"

/* x (fp32, row stride ldx) rounded per block and multiplied with VNNI; -1: no memory */
VNNI512_TARGET static int q512_linear_i8(const float *xf, int64_t ldx, const uint8_t *qw,
                                         const uint16_t *sc, void *y, int64_t ldy, int64_t M,
                                         int64_t N, int64_t K, const float *bias, int dtype,
                                         int bits, char *buf) {
    const int64_t KB = K / 32;
    float *xd = (float *)buf, *xs = xd + M * KB;
    int8_t *xq = (int8_t *)(xs + M * KB);
    sgl_round_x_blocks(xf, ldx, M, KB, xq, xd, xs);
    quant_i8_job job = {qw, sc, y, bias, ldy, M, N, KB, dtype, bits, xq, xd, xs};
    const int64_t quads = (N + 3) / 4;
    sgl_parallel_for(i8_quads, &job, quads, chunk_of(quads));
    return 0;
}

/* The arguments and return codes of sgl_linear_quant_avx2 (kernels_quant_avx2.c), and bf16_dot:
   the level has AVX512-BF16 (vdpbf16ps). */
PANEL512_TARGET int sgl_linear_quant_avx512(const void *x, int64_t ldx, const uint8_t *qw,
                                            const uint16_t *sc, void *y, int64_t ldy, int64_t M,
                                            int64_t N, int64_t K, const float *bias, int dtype,
                                            int bits, int round_x, int bf16_dot) {
    if (bits != 4 && bits != 8) return -2;
    if (!round_x && dtype && M >= Q512_PANEL_ROWS)
        return q512_linear_panels(x, ldx, qw, sc, y, ldy, M, N, K, bias, bits, bf16_dot);
    if (!round_x || !HAS_VNNI())
        return sgl_linear_quant_avx2(x, ldx, qw, sc, y, ldy, M, N, K, bias, dtype, bits,
                                     round_x);
    const float *xf = x;
    const int64_t KB = K / 32;
    /* fp32 copy of a bfloat16 x, then the int8 blocks and their dx, dx * sum */
    const size_t copy_bytes = dtype ? (size_t)(M * K) * 4 : 0;
    const size_t round_bytes = (size_t)(M * K) + (size_t)(2 * M * KB) * 4 + 64;
    char *buf = sgl_scratch(1, copy_bytes + round_bytes);
    if (!buf) return -1;
    if (dtype) { /* a bfloat16 is the top half of its float32 */
        float *copy = (float *)buf;
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
    return q512_linear_i8(xf, ldx, qw, sc, y, ldy, M, N, K, bias, dtype, bits, buf + copy_bytes);
}

#endif
