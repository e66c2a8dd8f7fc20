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
 * rounds it (sgl_round_x_blocks), the products are summed exactly in int32 and scaled in
 * quant_round_x.h's one float sequence: below I8G_ROWS rows its tiles (one 256-bit vpdpbusd per
 * block and column where the AVX2 kernel takes vpmaddubsw and vpmaddwd), from I8G_ROWS rows 16
 * columns in the lanes of 512-bit vpdpbusd (i8g_*). Both give a row the same bits.
 *
 * Decode shapes without round_x stay with the AVX2 kernel: a 16-lane version of its tiles, and
 * one multiplying the blocks' integers as bfloat16 with vdpbf16ps, both measured no faster on
 * Zen 4 (docs/benchmarks.md, "Quantized matmuls on AVX-512").
 */
#if defined(SGL_EMULATE_ISA)
#include "isa_emulation.h"

#define VNNI512_TARGET
#define PANEL512_TARGET
#define BF16_512_TARGET
#define QAMX_TARGET
#define HAS_VNNI() 1
#elif defined(__x86_64__)
#include <immintrin.h>

#define VNNI512_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define PANEL512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define BF16_512_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
#define QAMX_TARGET                                                                        \
    __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni," \
                          "avx2,fma,f16c")))
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
    sgl_parallel_for(q512_panels, &job, panels, panels_per_thread(panels));
    return atomic_load(&job.no_memory) ? -1 : 0;
}

/* dwords p0 .. p3 (4 bytes each) of the 16 columns' 16-byte rows src[c] (stride bytes apart),
   transposed: dword i of column c goes to dword c of out[i] */
PANEL512_TARGET Q512_INLINE void i8g_transpose16x4(const uint8_t *src, int64_t stride,
                                                  int64_t cols, __m512i out[4]) {
    __m128i row[16];
    #pragma GCC unroll 16
    for (int c = 0; c < 16; c++)
        row[c] = c < cols ? _mm_loadu_si128((const __m128i *)(src + c * stride))
                          : _mm_setzero_si128();
    __m512i z[4]; /* z[g]'s 128-bit lane l: column 4 l + g */
    #pragma GCC unroll 4
    for (int g = 0; g < 4; g++)
        z[g] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(
            _mm512_castsi128_si512(row[g]), row[4 + g], 1), row[8 + g], 2), row[12 + g], 3);
    /* 4 x 4 transposes in each lane: dword g of lane l then holds column 4 l + g */
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The scales of every block of the 16 columns n0 .. n0 + cols (zero past them) as float32:
   d[kb * 16 + c], m[kb * 16 + c] (64-byte aligned), each column's (d, m) pairs of 16 blocks
   read as dwords and transposed to a block's 16 columns. */
PANEL512_TARGET static void q512_scales16(const uint16_t *sc, int64_t KB, int64_t n0,
                                          int64_t cols, float *d, float *m) {
    for (int64_t kb0 = 0; kb0 < KB; kb0 += 16) {
        const int64_t n = KB - kb0 < 16 ? KB - kb0 : 16;
        const __mmask16 blocks = (__mmask16)((1u << n) - 1);
        __m512i pairs[16];
        #pragma GCC unroll 16
        for (int c = 0; c < 16; c++)
            pairs[c] = c < cols ? _mm512_castps_si512(_mm512_maskz_loadu_ps(
                                      blocks, sc + ((n0 + c) * KB + kb0) * 2))
                                : _mm512_setzero_si512();
        q512_transpose16(pairs);
        for (int64_t b = 0; b < n; b++) {
            const __m256i dh = _mm512_cvtepi32_epi16(pairs[b]);
            const __m256i mh = _mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs[b], 16));
            float *db = d + (kb0 + b) * 16, *mb = m + (kb0 + b) * 16;
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256 dv = _mm256_cvtph_ps(h ? _mm256_extracti128_si256(dh, 1)
                                                    : _mm256_castsi256_si128(dh));
                const __m256 mv = _mm256_cvtph_ps(h ? _mm256_extracti128_si256(mh, 1)
                                              : _mm256_castsi256_si128(mh));
                _mm256_store_ps(db + 8 * h, dv);
                _mm256_store_ps(mb + 8 * h, mv);
            }
        }
    }
}

/* -- bfloat16 rows below Q512_PANEL_ROWS: the panels' products, a block at a time -----------
 * The columns are taken 32 at a time (two vectors of 16); each block of them is widened to the
 * panels' bfloat16 pairs (d q + m rounded, value 2p in the low half of dword p) into a 2 KiB
 * panel on the stack, which every row multiplies pair by pair with the panels' steps (vdpbf16ps,
 * or the two FMAs of the widened kernel). Per row and column that is the chain of
 * sgl_bf16_panel_avx512 over the same values in the same order, so a row's result does not
 * depend on how many rows the call has: a request's tokens are the same alone, in a batch, or
 * after a prefix-cache hit. The integers come with the 16 columns in the lanes (a byte
 * transpose), so no 16 x 16 transpose per block is needed. */

/* block kb's scales of the 16 columns n0 .. n0 + cols (from q512_scales16's ds, ms), and its
   integers: t[i], lane c = bytes 4i .. 4i + 3 of column c (zero past cols; q4: t[0..3], q8:
   t[0..7]) */
PANEL512_TARGET Q512_INLINE void q512s_block16(const q512_panel_job *j, int64_t n0,
                                               int64_t cols, int64_t kb, const float *ds,
                                               const float *ms, __m512 *d, __m512 *m,
                                               __m512i t[8], const int BITS) {
    const int64_t KB = j->KB, qb = BITS == 4 ? 16 : 32;
    *d = _mm512_load_ps(ds + kb * 16);
    *m = _mm512_load_ps(ms + kb * 16);
    const uint8_t *q = j->qw + (n0 * KB + kb) * qb;
    i8g_transpose16x4(q, KB * qb, cols, t);
    if (BITS == 8) i8g_transpose16x4(q + 16, KB * qb, cols, t + 4);
}

/* The 32 columns' integers read across the rows, 16 bytes (q4) or 32 (q8) from each at a
   time, which the hardware's prefetchers do not follow: when block kb starts a cache line of
   every column's row, the line Q512S_AHEAD lines on comes into L1. */
#define Q512S_AHEAD 2
PANEL512_TARGET Q512_INLINE void q512s_prefetch(const q512_panel_job *j, int64_t n0, int64_t cols,
                                               int64_t kb, const int BITS) {
    const int64_t qb = BITS == 4 ? 16 : 32;
    if ((kb * qb) % 64) return;
    const int64_t at = (kb * qb) + Q512S_AHEAD * 64;
    if (at >= j->KB * qb) return;
    for (int64_t c = 0; c < cols; c++)
        _mm_prefetch((const char *)(j->qw + (n0 + c) * j->KB * qb + at), _MM_HINT_T0);
}

/* d q + m rounded to bfloat16 (ties to even; the weights are finite), as q512_block_pairs */
PANEL512_TARGET Q512_INLINE __m512i q512s_rounded(__m512i q, __m512 d, __m512 m) {
    const __m512i u = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
}

/* the integers of values 2p (e) and 2p + 1 (o) of the block, p < 16 constant after unrolling,
   for the 16 columns of q512s_block16 */
PANEL512_TARGET Q512_INLINE void q512s_ints(const __m512i t[8], const int p, const int BITS,
                                           __m512i *e, __m512i *o) {
    const int b = 2 * (p & 1); /* value 2p is byte b of its dword */
    if (BITS == 4) { /* value 2p: nibble h of byte 4i + b, 2p = 16 h + 4 i + b */
        const int h = p >> 3, i = (p >> 1) & 3;
        const __m512i low = _mm512_set1_epi32(0x0F);
        *e = _mm512_and_si512(_mm512_srli_epi32(t[i], 8 * b + 4 * h), low);
        *o = _mm512_and_si512(_mm512_srli_epi32(t[i], 8 * b + 8 + 4 * h), low);
    } else { /* value 2p: byte b of dword p / 2, signed */
        *e = _mm512_srai_epi32(_mm512_slli_epi32(t[p >> 1], 24 - 8 * b), 24);
        *o = _mm512_srai_epi32(_mm512_slli_epi32(t[p >> 1], 16 - 8 * b), 24);
    }
}

/* pair p of the block for the 16 columns: values 2p (low half) and 2p + 1 as bfloat16 */
PANEL512_TARGET Q512_INLINE __m512i q512s_pair(const __m512i t[8], __m512 d, __m512 m,
                                              const int p, const int BITS) {
    __m512i e, o;
    q512s_ints(t, p, BITS, &e, &o);
    return _mm512_or_si512(_mm512_srli_epi32(q512s_rounded(e, d, m), 16),
                           _mm512_and_si512(q512s_rounded(o, d, m),
                                            _mm512_set1_epi32((int)0xffff0000u)));
}

/* q512s_pair with AVX512-BF16's rounding instruction: the same bits (ties to even; the values
   d q + m are multiples of 2^-24, so never denormal, which the instruction would flush), the
   two halves then interleaved by one word permute */
BF16_512_TARGET Q512_INLINE __m512i q512s_pair_bf16(const __m512i t[8], __m512 d, __m512 m,
                                                   const int p, const int BITS) {
    __m512i e, o;
    q512s_ints(t, p, BITS, &e, &o);
    const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(o), d, m), _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), d, m));
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    return _mm512_permutexvar_epi16(order, words);
}

/* block kb of the 32 columns n0 .. n0 + cols (zero past them) as w[p * 2 + half] */
#define Q512S_WIDEN(NAME, TARGET, PAIR)                                                        \
    TARGET Q512_INLINE void NAME(const q512_panel_job *j, int64_t n0, int64_t cols,           \
                                 int64_t kb, const float *sc, __m512i *w, const int BITS) {   \
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {                        \
            if (16 * half >= cols) {                                                           \
                for (int p = 0; p < 16; p++) w[p * 2 + half] = _mm512_setzero_si512();         \
                continue;                                                                      \
            }                                                                                  \
            __m512 d, m;                                                                       \
            __m512i t[8];                                                                      \
            q512s_block16(j, n0 + 16 * half, cols - 16 * half, kb, sc + half * 32 * j->KB,     \
                          sc + (half * 32 + 16) * j->KB, &d, &m, t, BITS);                     \
            _Pragma("GCC unroll 16") for (int p = 0; p < 16; p++)                              \
                w[p * 2 + half] = PAIR(t, d, m, p, BITS);                                      \
        }                                                                                      \
    }
Q512S_WIDEN(q512s_widen_dp, BF16_512_TARGET, q512s_pair_bf16)
Q512S_WIDEN(q512s_widen, PANEL512_TARGET, q512s_pair)

/* one pair's step of the widened kernel (bf16_panel_widen): x's even value times the weight's
   even one, then the odd ones, each an FMA into acc */
PANEL512_TARGET Q512_INLINE __m512 q512s_fma_pair(__m512 acc, __m512 xe, __m512 xo, __m512i w) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    return _mm512_fmadd_ps(xo, _mm512_castsi512_ps(_mm512_and_si512(w, hi)),
                           _mm512_fmadd_ps(xe, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc));
}

/* acc[r * 2 + half] of ROWS rows carried over one block (x at the block's first value): the
   steps of bf16_panel_dp (DP) or bf16_panel_widen */
#define Q512S_ROWS(NAME, TARGET, DP)                                                           \
    TARGET Q512_INLINE void NAME(const uint16_t *x, int64_t ldx, const __m512i *w,           \
                                 __m512 *acc, const int ROWS) {                                \
        __m512 a[4][2];                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {                               \
            a[r][0] = acc[r * 2];                                                              \
            a[r][1] = acc[r * 2 + 1];                                                          \
        }                                                                                      \
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);                                \
        for (int p = 0; p < 16; p++) {                                                         \
            const __m512i w0 = w[p * 2], w1 = w[p * 2 + 1];                                    \
            _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {                           \
                uint32_t pair;                                                                 \
                memcpy(&pair, x + r * ldx + 2 * p, 4);                                         \
                const __m512i xv = _mm512_set1_epi32((int)pair);                               \
                if (DP) {                                                                      \
                    a[r][0] = Q512S_DP(a[r][0], xv, w0);                                       \
                    a[r][1] = Q512S_DP(a[r][1], xv, w1);                                       \
                } else {                                                                       \
                    const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));          \
                    const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(xv, hi));           \
                    a[r][0] = q512s_fma_pair(a[r][0], xe, xo, w0);                             \
                    a[r][1] = q512s_fma_pair(a[r][1], xe, xo, w1);                             \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {                               \
            acc[r * 2] = a[r][0];                                                              \
            acc[r * 2 + 1] = a[r][1];                                                          \
        }                                                                                      \
    }

#define Q512S_DP(acc, xv, wv) _mm512_dpbf16_ps((acc), (__m512bh)(xv), (__m512bh)(wv))
Q512S_ROWS(q512s_rows_dp, BF16_512_TARGET, 1)
#undef Q512S_DP
#define Q512S_DP(acc, xv, wv) (acc)
Q512S_ROWS(q512s_rows_widen, PANEL512_TARGET, 0)
#undef Q512S_DP

/* One row: its 32 sums in registers over all of K, each pair vector used as it is made (no
   stack panel); the same steps in the same order as the rows functions */
#define Q512S_DIRECT(NAME, TARGET, PAIR, DP)                                                   \
    TARGET Q512_INLINE void NAME(const q512_panel_job *j, int64_t n0, int64_t cols,           \
                                 const float *sc, __m512 *acc, const int BITS) {              \
        __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};                              \
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);                                \
        for (int64_t kb = 0; kb < j->KB; kb++) {                                               \
            q512s_prefetch(j, n0, cols, kb, BITS);                                             \
            __m512 d[2], m[2];                                                                 \
            __m512i t[2][8];                                                                   \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                \
                if (16 * h < cols)                                                             \
                    q512s_block16(j, n0 + 16 * h, cols - 16 * h, kb, sc + h * 32 * j->KB,      \
                                  sc + (h * 32 + 16) * j->KB, d + h, m + h, t[h], BITS);       \
            const uint16_t *x = j->x + kb * 32;                                                \
            _Pragma("GCC unroll 16") for (int p = 0; p < 16; p++) {                            \
                uint32_t pair;                                                                 \
                memcpy(&pair, x + 2 * p, 4);                                                   \
                const __m512i xv = _mm512_set1_epi32((int)pair);                               \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                          \
                    if (16 * h >= cols) continue;                                              \
                    const __m512i w = PAIR(t[h], d[h], m[h], p, BITS);                         \
                    if (DP) {                                                                  \
                        a[h] = Q512S_DP(a[h], xv, w);                                          \
                    } else {                                                                   \
                        const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));      \
                        const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(xv, hi));       \
                        a[h] = q512s_fma_pair(a[h], xe, xo, w);                                \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        acc[0] = a[0];                                                                         \
        acc[1] = a[1];                                                                         \
    }

#define Q512S_DP(acc, xv, wv) _mm512_dpbf16_ps((acc), (__m512bh)(xv), (__m512bh)(wv))
Q512S_DIRECT(q512s_direct_dp, BF16_512_TARGET, q512s_pair_bf16, 1)
#undef Q512S_DP
#define Q512S_DP(acc, xv, wv) (acc)
Q512S_DIRECT(q512s_direct_widen, PANEL512_TARGET, q512s_pair, 0)
#undef Q512S_DP

/* the groups of 32 columns g_begin .. g_end for all M (< Q512_PANEL_ROWS) rows */
#define Q512S_GROUPS(NAME, TARGET, ROWS_FN, WIDEN, DIRECT)                             \
    TARGET static void NAME(void *ctx, int64_t g_begin, int64_t g_end) {                      \
        q512_panel_job *j = ctx;                                                               \
        __m512i w[32];                                                                         \
        /* per half of the group: d [KB][16], then m [KB][16] */                               \
        float *sc = sgl_scratch(0, (size_t)(j->KB * 64) * 4);                                  \
        if (!sc) {                                                                             \
            atomic_store(&j->no_memory, 1);                                                    \
            return;                                                                            \
        }                                                                                      \
        __m512 acc[Q512_PANEL_ROWS * 2];                                                       \
        const int64_t M = j->M;                                                                \
        for (int64_t g = g_begin; g < g_end; g++) {                                            \
            const int64_t n0 = 32 * g, cols = j->N - n0 < 32 ? j->N - n0 : 32;                 \
            for (int64_t h = 0; h < 2 && 16 * h < cols; h++)                                   \
                q512_scales16(j->sc, j->KB, n0 + 16 * h, cols - 16 * h, sc + h * 32 * j->KB,   \
                              sc + (h * 32 + 16) * j->KB);                                  \
            if (M == 1) {                                                                      \
                if (j->bits == 4) DIRECT(j, n0, cols, sc, acc, 4);                             \
                else DIRECT(j, n0, cols, sc, acc, 8);                                          \
            }                                                                                  \
            for (int64_t i = 0; M > 1 && i < 2 * M; i++) acc[i] = _mm512_setzero_ps();         \
            for (int64_t kb = 0; M > 1 && kb < j->KB; kb++) {                                  \
                if (j->bits == 4) q512s_prefetch(j, n0, cols, kb, 4);                          \
                else q512s_prefetch(j, n0, cols, kb, 8);                                       \
                if (j->bits == 4) WIDEN(j, n0, cols, kb, sc, w, 4);                            \
                else WIDEN(j, n0, cols, kb, sc, w, 8);                                         \
                const uint16_t *x = j->x + kb * 32;                                            \
                int64_t r = 0;                                                                 \
                for (; r + 4 <= M; r += 4) ROWS_FN(x + r * j->ldx, j->ldx, w, acc + 2 * r, 4); \
                switch (M - r) {                                                               \
                case 3: ROWS_FN(x + r * j->ldx, j->ldx, w, acc + 2 * r, 3); break;             \
                case 2: ROWS_FN(x + r * j->ldx, j->ldx, w, acc + 2 * r, 2); break;             \
                case 1: ROWS_FN(x + r * j->ldx, j->ldx, w, acc + 2 * r, 1); break;             \
                default: break;                                                                \
                }                                                                              \
            }                                                                                  \
            const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);          \
            const __mmask16 m1 = cols >= 32 ? 0xFFFF                                           \
                                 : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;       \
            const __m512 b0 = j->bias ? _mm512_maskz_loadu_ps(m0, j->bias + n0)               \
                                      : _mm512_setzero_ps();                                   \
            const __m512 b1 = j->bias && m1 ? _mm512_maskz_loadu_ps(m1, j->bias + n0 + 16)    \
                                            : _mm512_setzero_ps();                             \
            for (int64_t r = 0; r < M; r++) {                                                  \
                q512s_store(j->y + r * j->ldy + n0, _mm512_add_ps(acc[2 * r], b0), m0);        \
                if (m1) q512s_store(j->y + r * j->ldy + n0 + 16,                               \
                                    _mm512_add_ps(acc[2 * r + 1], b1), m1);                    \
            }                                                                                  \
        }                                                                                      \
    }

/* v rounded to bfloat16 (ties to even; a NaN stays a NaN) into the lanes of `keep` */
PANEL512_TARGET Q512_INLINE void q512s_store(uint16_t *y, __m512 v, __mmask16 keep) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i h = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    h = _mm512_mask_mov_epi32(h, nan, _mm512_srli_epi32(
        _mm512_or_si512(u, _mm512_set1_epi32(0x400000)), 16));
    _mm256_mask_storeu_epi16(y, keep, _mm512_cvtepi32_epi16(h));
}

Q512S_GROUPS(q512s_groups_dp, BF16_512_TARGET, q512s_rows_dp, q512s_widen_dp, q512s_direct_dp)
Q512S_GROUPS(q512s_groups_widen, PANEL512_TARGET, q512s_rows_widen, q512s_widen, q512s_direct_widen)

/* bfloat16 x [M, K] below Q512_PANEL_ROWS rows, the panels' products a block at a time */
PANEL512_TARGET static int q512_linear_small(const uint16_t *x, int64_t ldx, const uint8_t *qw,
                                              const uint16_t *sc, uint16_t *y, int64_t ldy,
                                              int64_t M, int64_t N, int64_t K,
                                              const float *bias, int bits, int dp) {
    q512_panel_job job = {x, NULL, qw, sc, y, bias, ldx, K, ldy, M, N, K / 32, bits, dp, 0};
    const int64_t groups = (N + 31) / 32;
    sgl_parallel_for(dp ? q512s_groups_dp : q512s_groups_widen, &job, groups,
                     panels_per_thread(groups));
    return atomic_load(&job.no_memory) ? -1 : 0;
}

/* -- round_x: integer products with VNNI (quant_round_x.h) ---------------------------------- */

#define ROUND_X_TARGET VNNI512_TARGET
#define ROUND_X_VNNI 1 /* one vpdpbusd per block */
#include "quant_round_x.h"

/* -- round_x, many rows: 16 columns in the lanes of 512-bit vpdpbusd ------------------------ */

#define I8G_ROWS 8 /* the tile's rows */
#define I8G_FROM 8 /* from this many rows the 16-column tiles */

typedef struct {
    const uint8_t *qw;
    const uint16_t *sc;
    void *y;
    const float *bias;
    int64_t ldy, M, N, KB;
    int dtype, bits;
    const int8_t *xq;     /* x rounded per block: int8 [M, K] */
    const float *xd, *xs; /* per row and block: dx, dx * sum(q) */
    const int32_t *xi;    /* per row and block: sum(q) */
    atomic_int no_memory;
    const int32_t *xh; /* q6x16: per row and block, 32 sum(q) of each half (x16_half_sums) */
} i8g_job;

/* the 16 columns n0 .. n0 + cols of every block, in vpdpbusd's layout: w[kb][i], lane c holds
   the block's values 4i .. 4i + 3 of column n0 + c as unsigned bytes (q4: 0..15; q8: q + 128,
   128 sum(q) taken off the sums), d[kb] and m[kb] the columns' float32 scales */
VNNI512_TARGET static void i8g_pack(const i8g_job *j, int64_t n0, int64_t cols, __m512i *w,
                                    float *d, float *m) {
    const int64_t KB = j->KB, qb = j->bits == 4 ? 16 : 32;
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint8_t *src = j->qw + (n0 * KB + kb) * qb;
        __m512i *dst = w + kb * 8;
        __m512i t[4];
        i8g_transpose16x4(src, KB * qb, cols, t);
        if (j->bits == 4) { /* byte b: value b (low nibble) and b + 16 (high) */
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                dst[i] = _mm512_and_si512(t[i], low);
                dst[4 + i] = _mm512_and_si512(_mm512_srli_epi16(t[i], 4), low);
            }
        } else {
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) dst[i] = _mm512_xor_si512(t[i], flip);
            i8g_transpose16x4(src + 16, KB * qb, cols, t);
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) dst[4 + i] = _mm512_xor_si512(t[i], flip);
        }
    }
    q512_scales16(j->sc, KB, n0, cols, d, m);
}

/* one block of one row: its 16 columns' exact sums (for q8 with the 128 added to every weight
   in them) through quant_round_x.h's float sequence into acc; at = the row's index of the block
   in xd, xs and xi */
VNNI512_TARGET Q512_INLINE __m512 i8g_block_step(const i8g_job *j, __m512 acc, __m512i sum,
                                                 __m512 dv, __m512 mv, int64_t at) {
    if (j->bits == 8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * j->xi[at]));
    const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(j->xd[at]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
    return _mm512_fmadd_ps(mv, _mm512_set1_ps(j->xs[at]), acc);
}

/* acc[r] (+ bias) into y[r0 + r, n0 .. n0 + cols] for the rows r < ROWS below M, rounded to
   x's dtype */
VNNI512_TARGET Q512_INLINE void i8g_store_rows(const i8g_job *j, const __m512 *acc, int64_t r0,
                                               int64_t n0, int64_t cols, const int ROWS) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 bias = j->bias ? _mm512_maskz_loadu_ps(keep, j->bias + n0) : _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int r = 0; r < ROWS && r0 + r < j->M; r++) {
        const __m512 v = _mm512_add_ps(acc[r], bias);
        const int64_t at = (r0 + r) * j->ldy + n0;
        if (!j->dtype) _mm512_mask_storeu_ps((float *)j->y + at, keep, v);
        else q512s_store((uint16_t *)j->y + at, v, keep);
    }
}

/* y[r0 .. r0 + ROWS, n0 .. n0 + cols]: per block, each row's 4-byte groups broadcast into
   vpdpbusd with the 8 weight vectors (exact int32 sums), then quant_round_x.h's float sequence */
VNNI512_TARGET Q512_INLINE void i8g_tile(const i8g_job *j, const __m512i *w, const float *d,
                                         const float *m, int64_t r0, int64_t n0, int64_t cols,
                                         const char *next, int64_t next_lines, const int ROWS) {
    const int64_t per_block = (next_lines + j->KB - 1) / j->KB; /* lines of next to fetch */
    const int64_t KB = j->KB, K = KB * 32;
    const int8_t *xq = j->xq + r0 * K;
    __m512 acc[I8G_ROWS];
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; kb++) {
        __m512i sum[I8G_ROWS];
        #pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) sum[r] = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const __m512i wi = _mm512_load_si512((const void *)(w + kb * 8 + i));
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                int32_t four;
                memcpy(&four, xq + r * K + kb * 32 + 4 * i, 4);
                sum[r] = _mm512_dpbusd_epi32(sum[r], wi, _mm512_set1_epi32(four));
            }
        }
        if (next) /* the next group's weights and scales into L2, spread over the blocks */
            for (int64_t l = kb * per_block; l < (kb + 1) * per_block && l < next_lines; l++)
                _mm_prefetch(next + l * 64, _MM_HINT_T1);
        const __m512 dv = _mm512_load_ps(d + kb * 16), mv = _mm512_load_ps(m + kb * 16);
        #pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++)
            acc[r] = i8g_block_step(j, acc[r], sum[r], dv, mv, (r0 + r) * KB + kb);
    }
    i8g_store_rows(j, acc, r0, n0, cols, ROWS);
}

/* this thread's scratch for one packed group (i8g_pack's w, d, m); -1 (and the job told): none */
VNNI512_TARGET static int i8g_scratch(i8g_job *j, __m512i **w, float **d, float **m) {
    const int64_t KB = j->KB;
    char *buf = sgl_scratch(0, (size_t)(KB * 8) * 64 + (size_t)(KB * 32) * 4 + 64);
    if (!buf) {
        atomic_store(&j->no_memory, 1);
        return -1;
    }
    *w = (__m512i *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    *d = (float *)(*w + KB * 8);
    *m = *d + KB * 16;
    return 0;
}

/* the groups of 16 columns g_begin .. g_end: each packed into this thread's scratch, then
   multiplied by all the rows, 8 at a time */
VNNI512_TARGET static void i8g_groups(void *ctx, int64_t g_begin, int64_t g_end) {
    i8g_job *j = ctx;
    const int64_t KB = j->KB;
    __m512i *w;
    float *d, *m;
    if (i8g_scratch(j, &w, &d, &m)) return;
    const int64_t qb = j->bits == 4 ? 16 : 32;
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t n0 = 16 * g, cols = j->N - n0 < 16 ? j->N - n0 : 16;
        i8g_pack(j, n0, cols, w, d, m);
        /* while the first tile runs, the next group's integers (16 whole rows, contiguous) and
           scales come into L2: the pack reads them across the rows, which the hardware's
           prefetchers do not follow */
        const int64_t next = g + 1 < g_end ? 16 * (g + 1) : j->N;
        const int64_t next_cols = j->N - next < 16 ? j->N - next : 16;
        const char *next_w = (const char *)(j->qw + next * KB * qb);
        const char *next_s = (const char *)(j->sc + next * KB * 2);
        int64_t r = 0;
        for (; j->M - r >= 8; r += 8) {
            i8g_tile(j, w, d, m, r, n0, cols, r ? NULL : next_w,
                     next_cols > 0 ? (next_cols * KB * qb + 63) / 64 : 0, 8);
            if (r == 0 && next_cols > 0)
                for (int64_t l = 0; l < (next_cols * KB * 4 + 63) / 64; l++)
                    _mm_prefetch(next_s + l * 64, _MM_HINT_T1);
        }
        switch (j->M - r) {
        case 7: i8g_tile(j, w, d, m, r, n0, cols, NULL, 0, 7); break;
        case 6: i8g_tile(j, w, d, m, r, n0, cols, NULL, 0, 6); break;
        case 5: i8g_tile(j, w, d, m, r, n0, cols, NULL, 0, 5); break;
        case 4: i8g_tile(j, w, d, m, r, n0, cols, NULL, 0, 4); break;
        case 3: i8g_tile(j, w, d, m, r, n0, cols, NULL, 0, 3); break;
        case 2: i8g_tile(j, w, d, m, r, n0, cols, NULL, 0, 2); break;
        case 1: i8g_tile(j, w, d, m, r, n0, cols, NULL, 0, 1); break;
        default: break;
        }
    }
}

/* -- round_x, many rows at the amx level: the 16-column groups on AMX int8 tiles ------------
 * The packed group (i8g_pack) is, block by block, an 8-row B tile as it lies in memory (row i:
 * the 16 columns' values 4i .. 4i + 3, unsigned); x's rounded rows are the A tiles (16 rows x
 * one block of 32 signed values). Per block one TDPBSUD into a zeroed C tile gives 16 rows x 16
 * columns of exact block sums, which the rows then scale in quant_round_x.h's float sequence,
 * as i8g_tile does: the same bits. */

#define I8G_AMX_ROWS 16 /* from this many rows at the amx level */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} q512_tilecfg;

/* this thread's AMX tiles for one block at a time: C (0) 16 rows x 16 int32 sums, A (1) 16
   rows x one block of x, B (2) one block of 16 columns in vpdpbusd's layout */
QAMX_TARGET Q512_INLINE void i8g_amx_tiles(void) {
    q512_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = 16; cfg.colsb[0] = 64;
    cfg.rows[1] = 16; cfg.colsb[1] = 32;
    cfg.rows[2] = 8; cfg.colsb[2] = 64;
    _tile_loadconfig(&cfg);
}

/* y[m0 .. m0 + 16 (those below M), n0 .. n0 + cols] of the packed group (w, d, m); x's rounded
   rows are padded to a multiple of 16 with zero rows */
QAMX_TARGET Q512_INLINE void i8g_tile_amx(const i8g_job *j, const __m512i *w, const float *d,
                                          const float *m, int64_t m0, int64_t n0, int64_t cols) {
    const int64_t KB = j->KB, K = KB * 32;
    int32_t c[256] __attribute__((aligned(64)));
    __m512 acc[16];
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; kb++) {
        _tile_zero(0);
        _tile_loadd(1, j->xq + m0 * K + kb * 32, K);
        _tile_loadd(2, w + kb * 8, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, c, 64);
        const __m512 dv = _mm512_load_ps(d + kb * 16), mv = _mm512_load_ps(m + kb * 16);
        #pragma GCC unroll 16
        for (int r = 0; r < 16; r++)
            acc[r] = i8g_block_step(j, acc[r], _mm512_load_si512((const void *)(c + 16 * r)), dv,
                                    mv, (m0 + r) * KB + kb);
    }
    i8g_store_rows(j, acc, m0, n0, cols, 16);
}

/* the groups of 16 columns g_begin .. g_end on AMX: each packed into this thread's scratch, then
   multiplied by all the rows, 16 at a time */
QAMX_TARGET static void i8g_groups_amx(void *ctx, int64_t g_begin, int64_t g_end) {
    i8g_job *j = ctx;
    const int64_t KB = j->KB;
    __m512i *w;
    float *d, *m;
    if (i8g_scratch(j, &w, &d, &m)) return;
    i8g_amx_tiles();
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t n0 = 16 * g, cols = j->N - n0 < 16 ? j->N - n0 : 16;
        i8g_pack(j, n0, cols, w, d, m);
        for (int64_t m0 = 0; m0 < j->M; m0 += 16) i8g_tile_amx(j, w, d, m, m0, n0, cols);
    }
    _tile_release();
}

/* -- round_x on the 16-column layout (x16) -----------------------------------------------------
 * The weight packed once at load (sgl.kernels.quant.pack_x16) as i8g_pack lays out a group of
 * 16 columns, so that no call transposes anything: for each group, block after block, the
 * block's integers in vpdpbusd's layout (q4: 4 vectors of 64 bytes, lane c of vector i the
 * bytes 4i .. 4i + 3 of column c's 16, low nibbles values 4i .. 4i + 3, high nibbles 16 + 4i ..;
 * q8: 8 vectors, lane c of vector i column c's values 4i .. 4i + 3 plus 128), then the 16
 * columns' d and m as float16. A thread's groups are one sequential stream, every byte of it
 * used. The products and the float sequence are i8g_tile's: the same bits as every other
 * round_x tile. q6 (GGUF's Q6_K, W = d s (q - 32) with a scale s per 16 values) has its low
 * nibbles as q4's, its 2-bit highs in two more vectors, and its own block step in x16_tile,
 * on vpdpbusd at every level (AMX's block sums would need the halves apart). */

#define X16_AHEAD_BYTES 4096 /* how far ahead of the block being multiplied lines are asked for */

/* bytes per group and block: the integers (q4: 4 vectors, q8: 8), then 16 d and 16 m; q6: 4
   vectors of low nibbles, 2 of high bits, 16 s0 and 16 s1 (int8), 16 d */
static inline int64_t x16_block_bytes(int bits) {
    return bits == 4 ? 4 * 64 + 64 : bits == 6 ? 6 * 64 + 64 : 8 * 64 + 64;
}

/* a q4 block's 8 vectors of integers from its 4 vectors of nibbles: w[i] the low nibbles
   (values 4i .. 4i + 3 of each lane's column), w[4 + i] the high ones (16 + 4i ..) */
VNNI512_TARGET Q512_INLINE void x16_widen_q4(const uint8_t *blk, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(blk + 64 * i));
        w[i] = _mm512_and_si512(raw, low);
        w[4 + i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
}

/* a q6 block's 8 vectors of integers (0..63): q4's nibbles, then vector 4p + t takes bits 2t,
   2t + 1 of each byte of high vector p as its bits 4 and 5 (16-bit shifts: the bits crossing
   from the neighbouring byte are masked off) */
VNNI512_TARGET Q512_INLINE void x16_widen_q6(const uint8_t *blk, __m512i w[8]) {
    x16_widen_q4(blk, w);
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    #pragma GCC unroll 2
    for (int p = 0; p < 2; p++) {
        const __m512i h = _mm512_loadu_si512((const void *)(blk + 256 + 64 * p));
        /* 0xF8: a | (b & c) */
        w[4 * p] = _mm512_ternarylogic_epi32(w[4 * p], _mm512_slli_epi16(h, 4), bits45, 0xF8);
        w[4 * p + 1] =
            _mm512_ternarylogic_epi32(w[4 * p + 1], _mm512_slli_epi16(h, 2), bits45, 0xF8);
        w[4 * p + 2] = _mm512_ternarylogic_epi32(w[4 * p + 2], h, bits45, 0xF8);
        w[4 * p + 3] =
            _mm512_ternarylogic_epi32(w[4 * p + 3], _mm512_srli_epi16(h, 2), bits45, 0xF8);
    }
}

/* 32 times the sum of each half of each block of one rounded row (xq [KB * 32]) into xh [KB,
   2]: the 32 of q6's q - 32 */
VNNI512_TARGET static void x16_half_sums(const int8_t *xq, int64_t KB, int32_t *xh) {
    const __m128i flip = _mm_set1_epi8((char)0x80);
    for (int64_t i = 0; i < KB * 2; i++) { /* sad of x + 128 against 0: two 8-byte sums */
        const __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(xq + 16 * i)), flip);
        const __m128i s = _mm_sad_epu8(v, _mm_setzero_si128());
        xh[i] = 32 * (_mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128);
    }
}

/* y[r0 .. r0 + ROWS, the group's 16 columns] from group g's packed blocks; prefetch: whether to
   ask for the lines ahead (the first row tile of a group, which reads it from memory). q6 (BITS
   6): each half's products in its own chain, then per row s0 (sum0 - 32 xh0) + s1 (sum1 - 32
   xh1), exact in int32 and in float32 (|sum| < 2^24), and acc = fma(sum, d * dx, acc):
   linear_q6's sequence (m = 0) */
VNNI512_TARGET Q512_INLINE void x16_tile(const i8g_job *j, int64_t g, int64_t r0, int prefetch,
                                         const int BITS, const int ROWS) {
    const int64_t KB = j->KB, K = KB * 32, bb = x16_block_bytes(BITS), wb = bb - 64;
    const uint8_t *blocks = j->qw + g * KB * bb;
    const int8_t *xq = j->xq + r0 * K;
    __m512 acc[I8G_ROWS];
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint8_t *blk = blocks + kb * bb;
        if (prefetch)
            for (int64_t l = 0; l < bb; l += 64)
                _mm_prefetch((const char *)blk + X16_AHEAD_BYTES + l, _MM_HINT_T0);
        __m512i w[8];
        if (BITS == 4) {
            x16_widen_q4(blk, w);
        } else if (BITS == 6) {
            x16_widen_q6(blk, w);
        } else {
            #pragma GCC unroll 8
            for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512((const void *)(blk + 64 * i));
        }
        /* the 16 d: q6's after its two vectors of int8 scales; the others' before their m */
        const __m512 dv = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(blk + (BITS == 6 ? bb - 32 : wb))));
        /* a row's 8 products in one chain where 4 or more rows interleave theirs, in two
           (even and odd vectors) below, so that few rows do not wait on vpdpbusd's latency;
           q6: the two halves' chains */
        const int CH = BITS == 6 || ROWS < 4 ? 2 : 1;
        __m512i sum[I8G_ROWS][2];
        #pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const int c = BITS == 6 ? i / 4 : i % CH;
                int32_t four;
                memcpy(&four, xq + r * K + kb * 32 + 4 * i, 4);
                sum[r][c] = _mm512_dpbusd_epi32(sum[r][c], w[i], _mm512_set1_epi32(four));
            }
        if (BITS == 6) {
            const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 384)));
            const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 400)));
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const int64_t at = (r0 + r) * KB + kb;
                const __m512i t0 = _mm512_mullo_epi32(
                    _mm512_sub_epi32(sum[r][0], _mm512_set1_epi32(j->xh[2 * at])), s0);
                const __m512i t1 = _mm512_mullo_epi32(
                    _mm512_sub_epi32(sum[r][1], _mm512_set1_epi32(j->xh[2 * at + 1])), s1);
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(j->xd[at]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1)), scale,
                                         acc[r]);
            }
            continue;
        }
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + wb + 32)));
        #pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++)
            acc[r] = i8g_block_step(j, acc[r],
                                    CH == 2 ? _mm512_add_epi32(sum[r][0], sum[r][1]) : sum[r][0],
                                    dv, mv, (r0 + r) * KB + kb);
    }
    i8g_store_rows(j, acc, r0, 16 * g, 16, ROWS);
}

/* the groups of 16 columns g_begin .. g_end, all the rows, 8 at a time */
VNNI512_TARGET static void x16_groups(void *ctx, int64_t g_begin, int64_t g_end) {
    i8g_job *j = ctx;
    for (int64_t g = g_begin; g < g_end; g++) {
        int64_t r = 0;
        for (; j->M - r >= 8; r += 8)
            if (j->bits == 4) x16_tile(j, g, r, r == 0, 4, 8);
            else if (j->bits == 6) x16_tile(j, g, r, r == 0, 6, 8);
            else x16_tile(j, g, r, r == 0, 8, 8);
#define X16_REST(ROWS)                                               \
    case ROWS:                                                      \
        if (j->bits == 4) x16_tile(j, g, r, r == 0, 4, ROWS);       \
        else if (j->bits == 6) x16_tile(j, g, r, r == 0, 6, ROWS);  \
        else x16_tile(j, g, r, r == 0, 8, ROWS);                    \
        break;
        switch (j->M - r) {
            X16_REST(7) X16_REST(6) X16_REST(5) X16_REST(4) X16_REST(3) X16_REST(2) X16_REST(1)
        default: break;
        }
#undef X16_REST
    }
}

/* the groups g_begin .. g_end on AMX int8 tiles, 16 rows at a time: block by block the integers
   (q4 widened from its nibbles into the thread's stack) are the B tile, as in i8g_tile_amx */
QAMX_TARGET static void x16_groups_amx(void *ctx, int64_t g_begin, int64_t g_end) {
    i8g_job *j = ctx;
    const int64_t KB = j->KB, K = KB * 32, bb = x16_block_bytes(j->bits), wb = bb - 64;
    i8g_amx_tiles();
    __m512i wide[8];
    int32_t c[256] __attribute__((aligned(64)));
    for (int64_t g = g_begin; g < g_end; g++) {
        const uint8_t *blocks = j->qw + g * KB * bb;
        for (int64_t m0 = 0; m0 < j->M; m0 += 16) {
            __m512 acc[16];
            #pragma GCC unroll 16
            for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t kb = 0; kb < KB; kb++) {
                const uint8_t *blk = blocks + kb * bb;
                const void *b = blk;
                if (j->bits == 4) {
                    x16_widen_q4(blk, wide);
                    b = wide;
                }
                _tile_zero(0);
                _tile_loadd(1, j->xq + m0 * K + kb * 32, K);
                _tile_loadd(2, b, 64);
                _tile_dpbsud(0, 1, 2);
                _tile_stored(0, c, 64);
                const __m512 dv =
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + wb)));
                const __m512 mv =
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + wb + 32)));
                #pragma GCC unroll 16
                for (int r = 0; r < 16; r++)
                    acc[r] = i8g_block_step(j, acc[r],
                                            _mm512_load_si512((const void *)(c + 16 * r)), dv,
                                            mv, (m0 + r) * KB + kb);
            }
            i8g_store_rows(j, acc, m0, 16 * g, 16, 16);
        }
    }
    _tile_release();
}

typedef struct {
    const void *x; /* float32 or bfloat16 rows */
    int64_t ldx, KB;
    int dtype;
    int8_t *xq;
    float *xd, *xs;
    int32_t *xi;
    int32_t *xh; /* q6x16: the halves' sums too (x16_half_sums); NULL otherwise */
} i8_round_job;

/* rows r_begin .. r_end of x rounded per block (sgl_round_x_blocks), a bfloat16 row widened to
   float32 8 blocks at a time on the stack (a bfloat16 is the top half of its float32) */
VNNI512_TARGET static void i8_round_rows(void *ctx, int64_t r_begin, int64_t r_end) {
    const i8_round_job *j = ctx;
    const int64_t KB = j->KB;
    for (int64_t r = r_begin; r < r_end; r++) {
        int8_t *xq = j->xq + r * KB * 32;
        float *xd = j->xd + r * KB, *xs = j->xs + r * KB;
        int32_t *xi = j->xi + r * KB;
        if (!j->dtype) {
            sgl_round_x_blocks((const float *)j->x + r * j->ldx, KB * 32, 1, KB, xq, xd, xs, xi);
        } else {
            const uint16_t *row = (const uint16_t *)j->x + r * j->ldx;
            float wide[8 * 32];
            for (int64_t kb = 0; kb < KB; kb += 8) {
                const int64_t n = KB - kb < 8 ? KB - kb : 8;
                for (int64_t k = 0; k < n * 32; k += 16) {
                    const __m512i h = _mm512_cvtepu16_epi32(
                        _mm256_loadu_si256((const __m256i *)(row + kb * 32 + k)));
                    _mm512_storeu_ps(wide + k, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
                }
                sgl_round_x_blocks(wide, n * 32, 1, n, xq + kb * 32, xd + kb, xs + kb, xi + kb);
            }
        }
        if (j->xh) x16_half_sums(xq, KB, j->xh + r * KB * 2); /* while the row is in cache */
    }
}

/* x rounded per block (over the pool's threads from I8G_ROWS rows) and multiplied with VNNI:
   in the x16 layout (qw the packed weight, sc unused) by x16_groups at any number of rows, else
   few rows by quant_round_x.h's tiles, more by the 16-column groups; -1: no memory */
VNNI512_TARGET static int q512_linear_i8(const void *x, int64_t ldx, const uint8_t *qw,
                                         const uint16_t *sc, void *y, int64_t ldy, int64_t M,
                                         int64_t N, int64_t K, const float *bias, int dtype,
                                         int bits, int amx, int x16) {
    const int64_t KB = K / 32;
    amx = amx && M >= I8G_AMX_ROWS && bits != 6; /* q6: its halves' sums on vpdpbusd alone */
    const int64_t Mp = amx ? (M + 15) & ~(int64_t)15 : M; /* the AMX tiles' zero rows */
    const int64_t halves = bits == 6 ? 2 * Mp * KB : 0;
    char *buf = sgl_scratch(1, (size_t)(Mp * K) + (size_t)(3 * Mp * KB + halves) * 4 + 64);
    if (!buf) return -1;
    float *xd = (float *)buf, *xs = xd + Mp * KB;
    int32_t *xi = (int32_t *)(xs + Mp * KB), *xh = xi + Mp * KB;
    int8_t *xq = (int8_t *)(xh + halves);
    if (Mp > M) {
        memset(xq + M * K, 0, (size_t)((Mp - M) * K));
        memset(xd + M * KB, 0, (size_t)((Mp - M) * KB) * 4);
        memset(xs + M * KB, 0, (size_t)((Mp - M) * KB) * 4);
        memset(xi + M * KB, 0, (size_t)((Mp - M) * KB) * 4);
    }
    i8_round_job round = {x, ldx, KB, dtype, xq, xd, xs, xi, bits == 6 ? xh : NULL};
    if (x16) {
        if (M >= I8G_FROM) sgl_parallel_for(i8_round_rows, &round, M, chunk_of(M));
        else i8_round_rows(&round, 0, M);
        i8g_job job = {qw, NULL, y, bias, ldy, M, N, KB, dtype, bits, xq, xd, xs, xi, 0, xh};
        const int64_t groups = N / 16;
        sgl_parallel_for(amx ? x16_groups_amx : x16_groups, &job, groups,
                         panels_per_thread(groups));
        return 0;
    }
    if (M >= I8G_FROM) {
        sgl_parallel_for(i8_round_rows, &round, M, chunk_of(M));
        i8g_job job = {qw, sc, y, bias, ldy, M, N, KB, dtype, bits, xq, xd, xs, xi, 0};
        const int64_t groups = (N + 15) / 16;
        sgl_parallel_for(amx ? i8g_groups_amx : i8g_groups, &job, groups,
                         panels_per_thread(groups));
        return atomic_load(&job.no_memory) ? -1 : 0;
    }
    i8_round_rows(&round, 0, M);
    quant_i8_job job = {qw, sc, y, bias, ldy, M, N, KB, dtype, bits, xq, xd, xs, xi};
    const int64_t octets = (N + 7) / 8;
    sgl_parallel_for(i8_octets, &job, octets, panels_per_thread(octets));
    return 0;
}

/* The arguments and return codes of sgl_linear_quant_avx2 (kernels_quant_avx2.c), and level:
   bit 0, the level has AVX512-BF16 (vdpbf16ps); bit 1, it has AMX (int8 tiles for round_x);
   bit 2, qw is the weight in the x16 layout (N a multiple of 16, sc unused, round_x only, and
   only where the CPU has AVX512-VNNI: -2 otherwise), where bits may be 6 too (q6x16). */
PANEL512_TARGET int sgl_linear_quant_avx512(const void *x, int64_t ldx, const uint8_t *qw,
                                            const uint16_t *sc, void *y, int64_t ldy, int64_t M,
                                            int64_t N, int64_t K, const float *bias, int dtype,
                                            int bits, int round_x, int level) {
    const int bf16_dot = level & 1, x16 = (level >> 2) & 1;
    if (bits != 4 && bits != 8 && !(bits == 6 && x16)) return -2;
    if (x16)
        return round_x && HAS_VNNI() && N % 16 == 0
                   ? q512_linear_i8(x, ldx, qw, sc, y, ldy, M, N, K, bias, dtype, bits,
                                    (level >> 1) & 1, 1)
                   : -2;
    if (!round_x && dtype && M >= Q512_PANEL_ROWS)
        return q512_linear_panels(x, ldx, qw, sc, y, ldy, M, N, K, bias, bits, bf16_dot);
    if (!round_x && dtype)
        return q512_linear_small(x, ldx, qw, sc, y, ldy, M, N, K, bias, bits, bf16_dot);
    if (!round_x || !HAS_VNNI())
        return sgl_linear_quant_avx2(x, ldx, qw, sc, y, ldy, M, N, K, bias, dtype, bits,
                                     round_x);
    return q512_linear_i8(x, ldx, qw, sc, y, ldy, M, N, K, bias, dtype, bits, (level >> 1) & 1,
                          0);
}

#endif
