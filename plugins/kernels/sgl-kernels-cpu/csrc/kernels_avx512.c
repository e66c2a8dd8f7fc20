/* sgl's CPU kernels at the AMX, AVX512-BF16 and AVX-512 levels: bfloat16 and float32 matmuls,
 * paged decode and extend attention, RMSNorm, SiLU x up, rotary, argmax.
 *
 * Compiled when sgl-kernels-cpu is installed (setup.py) and called through run_op.c by the
 * torch operators of torch_ops.cpp. The matmuls split their columns over the pool's threads
 * (pool.c), the attentions their sequences or query tiles, the row-wise kernels (norm, SiLU x
 * up, rotary) their rows; argmax is single-threaded. Instruction sets are picked per function
 * (target attributes), so the file compiles with any x86-64 gcc >= 11 or clang, and the
 * operators only call what the CPU supports (the level set by sgl_cpu::set_level).
 * kernels_avx2.c holds the same kernels for CPUs with AVX2 and FMA only.
 */
#include "jobs.h"
#include "kernels.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(SGL_EMULATE_ISA)
/* kernels_avx512_emulated.c: the instructions in software (isa_emulation.h), on AVX2 */
#include "isa_emulation.h"

#define AMX_TARGET
#define AVX512_TARGET
#define AVX512_BF16_TARGET
#elif defined(__x86_64__)
#include <immintrin.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512vl,avx512bw")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

#if defined(__x86_64__)

/* Linux keeps AMX tile data off until the process asks for it (arch_prctl): sgl/kernels/cpu.py
 * asks before it picks the AMX level. */


/* -- bfloat16 linear on AMX ------------------------------------------------------------------
 * y[M, N] = x[M, K] . W^T (+ bias), x and y bfloat16 with row strides ldx / ldy, fp32 accumulation.
 * W [N, K] is packed by the caller as [Np/32][Kp/32][2][16][16][2]: for each pair of 16-column
 * blocks and each 32-wide K block, two 1 KiB B tiles in AMX's pair-interleaved (VNNI) layout, so
 * the weight streams from memory in one sequential pass per call. N and K are zero-padded to
 * multiples of 32 in the packed copy. Rows of x are handled 32 (then 16) at a time; a partial
 * last block of rows goes through a zero-padded scratch copy. */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} sgl_tilecfg;

/* lanes [0, left) of a 16-lane vector */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

#define PREFETCH_BLOCKS 4 /* K blocks (2 KiB of weight each) prefetched ahead */


AMX_TARGET static void store_tile_rows(uint16_t *y, int64_t ldy, const float *c, const float *bias,
                                       int rows, int cols) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(c + r * 16), b);
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

static inline int clamp16(int64_t n) { return n >= 16 ? 16 : (n > 0 ? (int)n : 0); }

/* Column pairs [np_begin, np_end) of the product; ``a`` is x padded to Mp rows and Kp columns
 * (row stride lda). */
AMX_TARGET static void linear_bf16_amx_pairs(const uint16_t *a, int64_t lda, const uint16_t *wp,
                                             uint16_t *y, int64_t ldy, int64_t M, int64_t N,
                                             int64_t K, const float *bias, int64_t np_begin,
                                             int64_t np_end) {
    const int64_t Kp = (K + 31) & ~(int64_t)31, KB = Kp / 32, NP = np_end;
    const int64_t Mp = (M + 15) & ~(int64_t)15;
    sgl_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    float c[4 * 256] __attribute__((aligned(64)));
    const int64_t sa = lda * 2;
    for (int64_t np = np_begin; np < NP; np++) {
        const uint16_t *wb = wp + np * KB * 1024;
        const int64_t n0 = np * 32;
        const int c0 = clamp16(N - n0), c1 = clamp16(N - n0 - 16);
        const float *b0 = bias ? bias + n0 : NULL, *b1 = bias ? bias + n0 + 16 : NULL;
        for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
            const uint16_t *am = a + m0 * lda;
            uint16_t *ym = y + m0 * ldy + n0;
            const int r0 = clamp16(M - m0), r1 = clamp16(M - m0 - 16);
            if (Mp - m0 >= 32) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kb = 0; kb < KB; kb++) {
                    const uint16_t *w = wb + kb * 1024;
                    if (kb + PREFETCH_BLOCKS < KB || np + 1 < NP)
                        for (int l = 0; l < 2048; l += 64)
                            _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * 1024) + l, _MM_HINT_T0);
                    _tile_loadd(6, w, 64);
                    _tile_loadd(7, w + 512, 64);
                    _tile_loadd(4, am + kb * 32, sa);
                    _tile_loadd(5, am + 16 * lda + kb * 32, sa);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
                _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
                store_tile_rows(ym, ldy, c, b0, r0, c0);
                if (c1) store_tile_rows(ym + 16, ldy, c + 256, b1, r0, c1);
                if (r1) {
                    store_tile_rows(ym + 16 * ldy, ldy, c + 512, b0, r1, c0);
                    if (c1) store_tile_rows(ym + 16 * ldy + 16, ldy, c + 768, b1, r1, c1);
                }
            } else {
                _tile_zero(0); _tile_zero(1);
                for (int64_t kb = 0; kb < KB; kb++) {
                    const uint16_t *w = wb + kb * 1024;
                    if (kb + PREFETCH_BLOCKS < KB || np + 1 < NP)
                        for (int l = 0; l < 2048; l += 64)
                            _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * 1024) + l, _MM_HINT_T0);
                    _tile_loadd(6, w, 64);
                    _tile_loadd(7, w + 512, 64);
                    _tile_loadd(4, am + kb * 32, sa);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
                _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
                store_tile_rows(ym, ldy, c, b0, r0, c0);
                if (c1) store_tile_rows(ym + 16, ldy, c + 256, b1, r0, c1);
            }
        }
    }
    _tile_release();
}

typedef struct {
    const uint16_t *a, *wp; /* a: x as bfloat16 (AMX, vdpbf16ps) */
    uint16_t *y;
    int64_t lda, ldy, M, N, K;
    const float *bias;
    const float *xf; /* x widened to fp32 (the AVX-512 kernel without dot products) */
} linear_job;

AMX_TARGET static void linear_bf16_amx_range(void *ctx, int64_t begin, int64_t end) {
    const linear_job *j = ctx;
    linear_bf16_amx_pairs(j->a, j->lda, j->wp, j->y, j->ldy, j->M, j->N, j->K, j->bias, begin,
                          end);
}

AMX_TARGET int sgl_linear_bf16_amx(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y,
                                   int64_t ldy, int64_t M, int64_t N, int64_t K,
                                   const float *bias) {
    const int64_t Kp = (K + 31) & ~(int64_t)31, NP = (N + 31) / 32;
    const int64_t Mp = (M + 15) & ~(int64_t)15;
    const uint16_t *a = x;
    int64_t lda = ldx;
    if (Mp != M || Kp != K) {
        uint16_t *s = scratch_bf16(Mp * Kp);
        if (!s) return -1;
        memset(s, 0, (size_t)(Mp * Kp * 2));
        for (int64_t r = 0; r < M; r++) memcpy(s + r * Kp, x + r * ldx, (size_t)(K * 2));
        a = s;
        lda = Kp;
    }
    linear_job job = {a, wp, y, lda, ldy, M, N, K, bias, NULL};
    /* a few claims per thread, so that a thread the OS delays costs little (not measured with
       one claim per thread, as the AVX-512 matmuls below now run: no AMX machine since) */
    sgl_parallel_for(linear_bf16_amx_range, &job, NP, chunk_of(NP));
    return 0;
}

/* -- float32 linear -------------------------------------------------------------------------
 * y[M, N] = x[M, K] . W^T (+ bias) in float32 for few rows (decode). W is packed by the caller
 * as [Np/32][K][32] (N zero-padded to a multiple of 32): a 32-column panel of W^T, read once
 * from memory per call while up to 8 rows of x are multiplied into it with broadcast FMAs; further
 * rows reuse the panel from cache. MKL's small-M sgemm repacks the weight on every call. */

AVX512_TARGET static inline __attribute__((always_inline)) void f32_tile(
    const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t K,
    const float *bias, __mmask16 m0, __mmask16 m1, const int rows) {
    __m512 a0[8], a1[8];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_load_ps(w + k * 32), w1 = _mm512_load_ps(w + k * 32 + 16);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);
        }
    }
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(a0[r], b0));
        if (m1) _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_add_ps(a1[r], b1));
    }
}

/* Column panels [np_begin, np_end) of the product. */
AVX512_TARGET static void linear_f32_panels(void *ctx, int64_t np_begin, int64_t np_end) {
    const linear_f32_job *j = ctx;
    const float *x = j->x, *wp = j->wp, *bias = j->bias;
    float *y = j->y;
    const int64_t ldx = j->ldx, ldy = j->ldy, M = j->M, N = j->N, K = j->K;
    for (int64_t np = np_begin; np < np_end; np++) {
        const float *w = wp + np * K * 32;
        const int64_t n0 = np * 32;
        const __mmask16 m0 = tail_mask(N - n0), m1 = N - n0 > 16 ? tail_mask(N - n0 - 16) : 0;
        const float *b = bias ? bias + n0 : NULL;
        for (int64_t r0 = 0; r0 < M; r0 += 8) {
            const float *xr = x + r0 * ldx;
            float *yr = y + r0 * ldy + n0;
            switch (M - r0 < 8 ? M - r0 : 8) { /* constant row counts keep the sums in registers */
            case 8: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 8); break;
            case 7: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 7); break;
            case 6: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 6); break;
            case 5: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 5); break;
            case 4: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 4); break;
            case 3: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 3); break;
            case 2: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 2); break;
            default: f32_tile(xr, ldx, w, yr, ldy, K, b, m0, m1, 1);
            }
        }
    }
}

/* The column panels are shared out over the kernel threads, as in sgl_linear_bf16_amx. */
AVX512_TARGET int sgl_linear_f32(const float *x, int64_t ldx, const float *wp, float *y,
                                 int64_t ldy, int64_t M, int64_t N, int64_t K, const float *bias) {
    return run_linear_f32(linear_f32_panels, x, ldx, wp, y, ldy, M, N, K, bias);
}

/* -- paged decode attention ------------------------------------------------------------------
 * One new token per sequence. For sequence b, its keys/values are the pool rows
 * table[rows[b] * table_stride + t] for t < lens[b] (the last being the new token's slot, loc[b],
 * which is written first from k_new / v_new when those are given). Query head h uses KV head
 * h / (Hq / Hk); the window keeps the last `window` keys (0: all); softcap > 0 applies
 * cap * tanh(s / cap) to the scaled scores. dtype: 0 = float32 tensors, 1 = bfloat16 tensors
 * (q, k/v pools, k_new/v_new and out alike). bf16_dot: the CPU has AVX512-BF16.
 *
 * Every query row gets the extend kernel's arithmetic (sgl_extend_attention, below), operation
 * for operation, so that a token's attention does not depend on whether it was decoded or
 * prefilled, after a cached prefix or not (docs/kernels.md, "Batch invariance"): its score with
 * a key is one chain of FMAs over d = 0 .. D - 1 (over the bfloat16 pairs on vdpbf16ps where the
 * extend kernel uses them), the keys go in blocks that end at multiples of EXT_KB under an online
 * softmax whose sum runs key by key, and each output column is one chain over the keys. The
 * extend kernel has its query rows in the lanes; a decode step has only G = Hq / Hk rows per KV
 * head, so here the lanes hold 16 keys (their K rows transposed) for the scores and 16 V columns
 * for the weighted sum. A work item is one sequence and KV head. */

AVX512_TARGET static inline __attribute__((always_inline)) __m512 load16(const void *p, int dtype) {
    if (dtype) return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps(p);
}

AVX512_TARGET static inline __attribute__((always_inline)) void store16(void *p, __m512 v, int dtype) {
    if (dtype) {
        /* round to nearest even, as torch does; NaN stays NaN */
        __m512i bits = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
        _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    } else {
        _mm512_storeu_ps(p, v);
    }
}

/* exp for x <= 0 (scores minus their maximum): Cody-Waite reduction and a degree-6 polynomial,
   within 2 ulp of expf over the range used here; exp(-inf) = 0. */
AVX512_TARGET static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* exp over the whole float range (overflow to inf, underflow to 0) */
AVX512_TARGET static inline __m512 exp_any(__m512 x) {
    __m512 big = _mm512_set1_ps(88.7228391f);
    __mmask16 over = _mm512_cmp_ps_mask(x, big, _CMP_GT_OQ);
    __m512 e = exp_nonpositive(_mm512_min_ps(x, big)); /* the reduction is valid for x > 0 too */
    return _mm512_mask_mov_ps(e, over, _mm512_set1_ps(INFINITY));
}

/* cap * tanh(s / cap) as the attention kernels compute it: tanh(y) = 1 - 2 / (e^2y + 1) */
AVX512_TARGET static inline __m512 softcapped(__m512 s, float cap) {
    const __m512 e2 = exp_any(_mm512_mul_ps(s, _mm512_set1_ps(2.0f / cap)));
    return _mm512_mul_ps(_mm512_set1_ps(cap), _mm512_sub_ps(
        _mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e2, _mm512_set1_ps(1.0f)))));
}

/* c[i] lane j = r[j] lane i: a 16 x 16 transpose of 32-bit elements */
AVX512_TARGET static inline __attribute__((always_inline)) void transpose16(const __m512 *r, __m512 *c) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d e = _mm512_castps_pd(t[4 * i + 1]), f = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(e, f));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(e, f));
    }
    /* u[4i + e], 128-bit lane L: element 4L + e of rows 4i .. 4i + 3 */
    for (int e = 0; e < 4; e++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44);
        const __m512 v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xEE);
        const __m512 w0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xEE);
        c[e] = _mm512_shuffle_f32x4(v0, w0, 0x88);
        c[4 + e] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
        c[8 + e] = _mm512_shuffle_f32x4(v1, w1, 0x88);
        c[12 + e] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
    }
}

/* kt[e][32] (e < D, or D / 2 bfloat16 pairs with `pairs`): the 32 keys of rows kr transposed,
   bfloat16 widened unless read as pairs */
AVX512_TARGET static inline __attribute__((always_inline)) void keys_transposed(
    const char *const *kr, int64_t D, float *kt, const int dtype, const int pairs) {
    const int64_t E = pairs ? D / 2 : D, es = dtype ? 2 : 4;
    for (int half = 0; half < 2; half++)
        for (int64_t e0 = 0; e0 < E; e0 += 16) {
            __m512 r[16], c[16];
            const __mmask16 m = tail_mask(E - e0); /* pairs: D / 2 may be 8 past a multiple of 16 */
            for (int j = 0; j < 16; j++)
                r[j] = pairs ? _mm512_maskz_loadu_ps(m, kr[16 * half + j] + e0 * 4)
                             : load16(kr[16 * half + j] + e0 * es, dtype);
            transpose16(r, c);
            for (int i = 0; i < 16 && e0 + i < E; i++) _mm512_store_ps(kt + (e0 + i) * 32 + 16 * half, c[i]);
        }
}

/* s[g * DEC_SLD + lane] (32 lanes) = sum over d in order of kt[d][lane] qs[g * D + d], one FMA
   chain per key and head as the extend kernel's ext_qk, for gn (<= 4) heads */
AVX512_TARGET static inline __attribute__((always_inline)) void dec_qk(const float *kt,
                                                                       const float *qs, int64_t D,
                                                                       float *s, const int gn) {
    __m512 acc[4][2];
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_load_ps(kt + d * 32), k1 = _mm512_load_ps(kt + d * 32 + 16);
#pragma GCC unroll 4
        for (int g = 0; g < gn; g++) {
            const __m512 qv = _mm512_set1_ps(qs[g * D + d]);
            acc[g][0] = _mm512_fmadd_ps(k0, qv, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(k1, qv, acc[g][1]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++) {
        _mm512_storeu_ps(s + g * DEC_SLD, acc[g][0]);
        _mm512_storeu_ps(s + g * DEC_SLD + 16, acc[g][1]);
    }
}

/* dec_qk on vdpbf16ps: kt [D/2][32] key pairs, q2 [gn][D/2] query pairs, as ext_qk_dp */
AVX512_BF16_TARGET static inline __attribute__((always_inline)) void dec_qk_dp(
    const float *kt, const uint32_t *q2, int64_t D, float *s, float scale, const int gn) {
    __m512 acc[4][2];
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + p * 32);
        const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + p * 32 + 16);
#pragma GCC unroll 4
        for (int g = 0; g < gn; g++) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)q2[g * (D / 2) + p]);
            acc[g][0] = _mm512_dpbf16_ps(acc[g][0], k0, qv);
            acc[g][1] = _mm512_dpbf16_ps(acc[g][1], k1, qv);
        }
    }
    const __m512 sv = _mm512_set1_ps(scale);
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++) {
        _mm512_storeu_ps(s + g * DEC_SLD, _mm512_mul_ps(acc[g][0], sv));
        _mm512_storeu_ps(s + g * DEC_SLD + 16, _mm512_mul_ps(acc[g][1], sv));
    }
}

/* The extend kernel's online-softmax step for the G query rows of an item over a block of nk
   keys whose first `masked` (0 or 1) are outside the window: the scores s[g][x] become the
   exponentials (0 where masked, and past nk up to a multiple of 16), the running maxima m[g] and
   sums l[g] advance, and alpha[g] is the factor of the output so far. */
AVX512_TARGET static void dec_softmax(float *s, int64_t G, int64_t nk, int64_t masked,
                                      float softcap, float *m, float *l, float *alpha) {
    for (int64_t g = 0; g < G; g++) {
        float *row = s + g * DEC_SLD;
        const float m_old = m[g];
        float mx = m_old;
        for (int64_t x = 0; x < nk; x += 16) {
            __m512 v = _mm512_loadu_ps(row + x);
            if (softcap > 0) v = softcapped(v, softcap);
            const __mmask16 live = tail_mask(nk - x) & (x == 0 ? (__mmask16)(0xffffu << masked) : 0xffffu);
            v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, v);
            _mm512_storeu_ps(row + x, v);
            const float bm = _mm512_reduce_max_ps(v);
            mx = bm > mx ? bm : mx;
        }
        const float m_safe = mx != -INFINITY ? mx : 0.0f;
        alpha[g] = 0.0f;
        if (m_old != -INFINITY) { /* the lanes' exp, not the C library's */
            float lanes[16];
            _mm512_storeu_ps(lanes, exp_nonpositive(_mm512_set1_ps(m_old - m_safe)));
            alpha[g] = lanes[0];
        }
        const __m512 mv = _mm512_set1_ps(m_safe);
        for (int64_t x = 0; x < nk; x += 16) {
            const __m512 v = _mm512_loadu_ps(row + x);
            const __mmask16 ok = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            _mm512_storeu_ps(row + x, _mm512_maskz_mov_ps(ok, exp_nonpositive(_mm512_sub_ps(v, mv))));
        }
        m[g] = mx;
    }
    /* the sums key by key, as the extend kernel's lanes add them; 8 rows' chains side by side */
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t gn = G - g0 < 8 ? G - g0 : 8;
        float sum[8];
        for (int64_t g = 0; g < gn; g++) sum[g] = l[g0 + g] * alpha[g0 + g];
        for (int64_t x = 0; x < nk; x++)
            for (int64_t g = 0; g < gn; g++) sum[g] += s[(g0 + g) * DEC_SLD + x];
        for (int64_t g = 0; g < gn; g++) l[g0 + g] = sum[g];
    }
}

/* o[g][col ..] = alpha[g] o[g][col ..] + the chain over the block's keys x of p[g][x] v_x, for gn
   (<= 4) heads and dv (<= 8) vectors of columns, as the extend kernel's ext_pv */
AVX512_TARGET static inline __attribute__((always_inline)) void dec_pv(
    const float *p, const char *const *vr, int64_t nk, float *o, int64_t Dv, int64_t col,
    const float *alpha, const int dtype, const int gn, const int dv) {
    const int64_t es = dtype ? 2 : 4;
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++)
#pragma GCC unroll 8
        for (int i = 0; i < dv; i++)
            acc[g][i] = _mm512_mul_ps(_mm512_load_ps(o + g * Dv + col + 16 * i), _mm512_set1_ps(alpha[g]));
    for (int64_t x = 0; x < nk; x++) {
        __m512 vv[8];
#pragma GCC unroll 8
        for (int i = 0; i < dv; i++) vv[i] = load16(vr[x] + (col + 16 * i) * es, dtype);
#pragma GCC unroll 4
        for (int g = 0; g < gn; g++) {
            const __m512 w = _mm512_set1_ps(p[g * DEC_SLD + x]);
#pragma GCC unroll 8
            for (int i = 0; i < dv; i++) acc[g][i] = _mm512_fmadd_ps(vv[i], w, acc[g][i]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++)
#pragma GCC unroll 8
        for (int i = 0; i < dv; i++) _mm512_store_ps(o + g * Dv + col + 16 * i, acc[g][i]);
}

/* dec_pv on vdpbf16ps, as the extend kernel's ext_pv_dp: keys in pairs (x, x + 1) from the
   block's start (an odd last key pairs with itself, probability 0), p16 the bfloat16
   probabilities (rows DEC_SLD * 2 apart), dv2 (<= 2) 32-column chunks whose sums lie in o in
   vpunpck{l,h}wd's column order */
AVX512_BF16_TARGET static inline __attribute__((always_inline)) void dec_pv_dp(
    const uint16_t *p16, const char *const *vr, int64_t nk, float *o, int64_t Dv, int64_t col,
    const float *alpha, const int gn, const int dv2) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++)
#pragma GCC unroll 4
        for (int i = 0; i < 2 * dv2; i++)
            acc[g][i] = _mm512_mul_ps(_mm512_load_ps(o + g * Dv + col + 16 * i), _mm512_set1_ps(alpha[g]));
    for (int64_t x = 0; x < nk; x += 2) {
        const char *r0 = vr[x] + col * 2, *r1 = vr[x + 1 < nk ? x + 1 : x] + col * 2;
        __m512i vv[4];
#pragma GCC unroll 2
        for (int i = 0; i < dv2; i++) {
            const __m512i a = _mm512_loadu_si512(r0 + i * 64), b = _mm512_loadu_si512(r1 + i * 64);
            vv[2 * i] = _mm512_unpacklo_epi16(a, b);
            vv[2 * i + 1] = _mm512_unpackhi_epi16(a, b);
        }
#pragma GCC unroll 4
        for (int g = 0; g < gn; g++) {
            int32_t pair;
            memcpy(&pair, p16 + g * 2 * DEC_SLD + x, 4);
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int i = 0; i < 2 * dv2; i++) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], w, (__m512bh)vv[i]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < gn; g++)
#pragma GCC unroll 4
        for (int i = 0; i < 2 * dv2; i++) _mm512_store_ps(o + g * Dv + col + 16 * i, acc[g][i]);
}

#define DEC_GN_SWITCH(CALL, GN)                                                                 \
    switch (GN) {                                                                               \
    case 4: CALL(4); break;                                                                     \
    case 3: CALL(3); break;                                                                     \
    case 2: CALL(2); break;                                                                     \
    default: CALL(1);                                                                           \
    }

#define DEC_QK_DP(GN) dec_qk_dp(kt, q2, D, s, scale, GN)
#define DEC_PV_DP2(GN) dec_pv_dp(p16, vr, nk, o, Dv, col, alpha, GN, 2)
#define DEC_PV_DP1(GN) dec_pv_dp(p16, vr, nk, o, Dv, col, alpha, GN, 1)

/* the calls of the vdpbf16ps steps from decode_item (compiled for AVX-512 only): gn heads from
   g0 on, constants inside */
AVX512_BF16_TARGET static void dec_qk_dp_heads(const float *kt, const uint32_t *q2, int64_t D,
                                               float *s, float scale, int64_t gn) {
    DEC_GN_SWITCH(DEC_QK_DP, gn)
}

AVX512_BF16_TARGET static void dec_pv_dp_heads(const uint16_t *p16, const char *const *vr,
                                               int64_t nk, float *o, int64_t Dv, int64_t col,
                                               const float *alpha, int64_t gn) {
    if (Dv - col >= 64) {
        DEC_GN_SWITCH(DEC_PV_DP2, gn)
    } else {
        DEC_GN_SWITCH(DEC_PV_DP1, gn)
    }
}

/* the block's probabilities of row g as bfloat16, at the start of the row */
AVX512_BF16_TARGET static void dec_probs_to_bf16(float *s, int64_t G, int64_t nk) {
    for (int64_t g = 0; g < G; g++) {
        float *row = s + g * DEC_SLD;
        for (int64_t x = 0; x < nk; x += 16) /* the writes stay behind the reads */
            _mm256_storeu_si256((__m256i *)((uint16_t *)row + x),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + x)));
    }
}

#undef DEC_QK_DP
#undef DEC_PV_DP2
#undef DEC_PV_DP1

/* Sequence b against KV head hk: dtype, dp (scores on vdpbf16ps) and pv_dp (the weighted sum
   too) are constants in each copy, so that the loads compile without branches. */
AVX512_TARGET static inline __attribute__((always_inline)) void decode_item(
    const attention_job *j, int64_t b, int64_t hk, const dec_buffers *w, const int dtype,
    const int dp, const int pv_dp) {
    const int64_t G = j->Hq / j->Hk, D = j->D, Dv = j->Dv, es = dtype ? 2 : 4;
    int64_t n;
    const int64_t start = decode_window_start(j, b, &n);
    n += start; /* keys start .. n - 1 */
    const int64_t *slots = j->table + j->rows[b] * j->table_stride;
    const char *qb = (const char *)j->q + (b * j->q_stride_t + hk * G * j->q_stride_h) * es;
    for (int64_t g = 0; g < G; g++) {
        const char *qg = qb + g * j->q_stride_h * es;
        if (dp) memcpy(w->qs + g * (D / 2), qg, (size_t)D * 2); /* the pairs, unscaled */
        else
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(w->qs + g * D + d,
                                 _mm512_mul_ps(load16(qg + d * es, dtype), _mm512_set1_ps(j->scale)));
        w->m[g] = -INFINITY;
        w->l[g] = 0.0f;
    }
    memset(w->o, 0, (size_t)(G * Dv) * sizeof(float));
    const char *kr[EXT_KB], *vr[EXT_KB];
    for (int64_t k0 = start & ~(int64_t)1, k1; k0 < n; k0 = k1) { /* the extend kernel's blocks */
        const int64_t nk = dec_block(j, slots, hk, k0, n, kr, vr, &k1);
        dec_ahead_advance(j, w->ahead, nk * (D + Dv) * es);
        for (int64_t x0 = 0; x0 < nk; x0 += 32) {
            const char *rows[32]; /* a short last group repeats its first key */
            for (int i = 0; i < 32; i++) rows[i] = kr[x0 + i < nk ? x0 + i : x0];
            keys_transposed(rows, D, w->kt, dtype, dp);
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                float *s = w->s + g0 * DEC_SLD + x0;
                const int64_t gn = G - g0 < 4 ? G - g0 : 4;
                if (dp) {
                    dec_qk_dp_heads(w->kt, (const uint32_t *)w->qs + g0 * (D / 2), D, s, j->scale, gn);
                } else {
#define DEC_QK(GN) dec_qk(w->kt, w->qs + g0 * D, D, s, GN)
                    DEC_GN_SWITCH(DEC_QK, gn)
#undef DEC_QK
                }
            }
        }
        dec_softmax(w->s, G, nk, k0 < start ? start - k0 : 0, j->softcap, w->m, w->l, w->alpha);
        if (pv_dp) {
            dec_probs_to_bf16(w->s, G, nk);
            for (int64_t col = 0; col < Dv; col += 64)
                for (int64_t g0 = 0; g0 < G; g0 += 4)
                    dec_pv_dp_heads((const uint16_t *)(w->s + g0 * DEC_SLD), vr, nk, w->o + g0 * Dv,
                                    Dv, col, w->alpha + g0, G - g0 < 4 ? G - g0 : 4);
        } else {
            for (int64_t col = 0; col < Dv;) {
                const int dv = Dv - col >= 128 ? 8 : 1;
                for (int64_t g0 = 0; g0 < G; g0 += 4) {
                    const float *p = w->s + g0 * DEC_SLD;
                    float *o = w->o + g0 * Dv;
#define DEC_PV(GN)                                                                              \
    if (dv == 8) dec_pv(p, vr, nk, o, Dv, col, w->alpha + g0, dtype, GN, 8);                    \
    else dec_pv(p, vr, nk, o, Dv, col, w->alpha + g0, dtype, GN, 1)
                    DEC_GN_SWITCH(DEC_PV, G - g0 < 4 ? G - g0 : 4)
#undef DEC_PV
                }
                col += 16 * dv;
            }
        }
    }
    char *ob = (char *)j->out + (b * j->out_stride_t + hk * G * Dv) * es;
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < G; g++) {
        const __m512 inv = _mm512_set1_ps(w->l[g] > 0 ? 1.0f / w->l[g] : 0.0f);
        const float *o = w->o + g * Dv;
        char *dst = ob + g * Dv * es;
        if (pv_dp) /* back from vpunpck{l,h}wd's column order */
            for (int64_t c = 0; c < Dv; c += 32) {
                const __m512 a = _mm512_load_ps(o + c), e = _mm512_load_ps(o + c + 16);
                store16(dst + c * 2, _mm512_mul_ps(_mm512_permutex2var_ps(a, lo, e), inv), 1);
                store16(dst + c * 2 + 32, _mm512_mul_ps(_mm512_permutex2var_ps(a, hi, e), inv), 1);
            }
        else
            for (int64_t c = 0; c < Dv; c += 16) store16(dst + c * es, _mm512_mul_ps(_mm512_load_ps(o + c), inv), dtype);
    }
}

#undef DEC_GN_SWITCH

/* Items [i0, i1) of a decode attention batch: item i is sequence i / Hk, KV head i % Hk. */
AVX512_TARGET static void decode_attention_items(void *ctx, int64_t i0, int64_t i1) {
    attention_job *j = ctx;
    dec_buffers w; /* per thread */
    if (dec_buffers_get(j, 32, &w)) {
        atomic_store(&j->failed, 1);
        return;
    }
    /* the extend kernel's choices: scores on vdpbf16ps for bfloat16 where the CPU has it, the
       weighted sum too where Dv % 32 == 0 and D >= 32 */
    const int dp = j->dtype && j->bf16_dot, pv_dp = dp && j->Dv % 32 == 0 && j->D >= 32;
    dec_ahead ahead = {i0, 0, i1};
    w.ahead = &ahead;
    dec_ahead_advance(j, &ahead, DEC_AHEAD_BYTES);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t b = i / j->Hk, hk = i % j->Hk;
        if (dp && pv_dp) decode_item(j, b, hk, &w, 1, 1, 1);
        else if (dp) decode_item(j, b, hk, &w, 1, 1, 0);
        else if (j->dtype) decode_item(j, b, hk, &w, 1, 0, 0);
        else decode_item(j, b, hk, &w, 0, 0, 0);
    }
}

/* The batch's sequences times KV heads are shared out over the kernel threads. */
AVX512_TARGET int sgl_decode_attention(
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_new, int64_t k_new_stride,
    const void *v_new, int64_t v_new_stride, void *k_pool, void *v_pool, const int64_t *table,
    int64_t table_stride, const int64_t *rows, const int64_t *lens, const int64_t *loc, void *out,
    int64_t out_stride_t, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, float scale,
    float softcap, int64_t window, int dtype, int bf16_dot) {
    return run_decode_attention(decode_attention_items, q, q_stride_t, q_stride_h, k_new,
                                k_new_stride, v_new, v_new_stride, k_pool, v_pool, table,
                                table_stride, rows, lens, loc, out, out_stride_t, B, Hq, Hk, D,
                                Dv, scale, softcap, window, dtype, bf16_dot);
}

/* -- elementwise ---------------------------------------------------------------------------
 * Each rounds to bfloat16 after every step where torch (and transformers' reference code) does,
 * so bfloat16 results match the torch code they replace bit for bit up to summation order. */

AVX512_TARGET static inline __m512 round_bf16(__m512 v) { /* fp32 -> nearest bf16 -> fp32 */
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, v);
}

AVX512_TARGET static inline __m512 load16m(const void *p, int dtype, __mmask16 m) {
    if (dtype) return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    return _mm512_maskz_loadu_ps(m, p);
}

AVX512_TARGET static inline void store16m(void *p, __m512 v, int dtype, __mmask16 m) {
    if (dtype) {
        __m512i r = _mm512_castps_si512(round_bf16(v));
        _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    } else {
        _mm512_mask_storeu_ps(p, m, v);
    }
}

/* h = x + residual (rounded to the dtype; skipped without residual), then
   out = weight * round(h / sqrt(mean(h^2) + eps)); res_out (may alias residual) receives h.
   Row t of the T rows of H values is x + (t / heads) * x_stride + (t % heads) * H: with
   heads > 1 (no residual then) each of `heads` consecutive H-wide parts of an x row is normed on
   its own (per-head q/k norms); out rows are o_stride apart. -1: bad heads. */
AVX512_TARGET static void rmsnorm_rows(void *ctx, int64_t t0, int64_t t1) {
    rmsnorm_job *j = ctx;
    const void *x = j->x, *residual = j->residual, *weight = j->weight;
    void *res_out = j->res_out, *out = j->out;
    const int64_t x_stride = j->x_stride, r_stride = j->r_stride, ro_stride = j->ro_stride,
                  o_stride = j->o_stride, H = j->H, heads = j->heads;
    const float eps = j->eps;
    const int dtype = j->dtype;
    const int64_t es = dtype ? 2 : 4;
    float *h = scratch_f32(H + 16); /* per thread */
    if (!h) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t t = t0; t < t1; t++) {
        const char *xr = (const char *)x + ((t / heads) * x_stride + (t % heads) * H) * es;
        const char *rr = residual ? (const char *)residual + t * r_stride * es : NULL;
        char *ror = res_out ? (char *)res_out + t * ro_stride * es : NULL;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            __mmask16 m = tail_mask(H - i);
            __m512 v = load16m(xr + i * es, dtype, m);
            if (rr) {
                v = _mm512_add_ps(v, load16m(rr + i * es, dtype, m));
                if (dtype) v = round_bf16(v);
                if (ror) store16m(ror + i * es, v, dtype, m);
            }
            _mm512_mask_storeu_ps(h + i, m, v);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps);
        const __m512 f = _mm512_set1_ps(inv);
        char *orow = (char *)out + t * o_stride * es;
        for (int64_t i = 0; i < H; i += 16) {
            __mmask16 m = tail_mask(H - i);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, h + i), f);
            if (dtype) v = round_bf16(v);
            store16m(orow + i * es, _mm512_mul_ps(v, load16m((const char *)weight + i * es, dtype, m)),
                     dtype, m);
        }
    }
}


AVX512_TARGET int sgl_rmsnorm(const void *x, int64_t x_stride, const void *residual,
                              int64_t r_stride, void *res_out, int64_t ro_stride,
                              const void *weight, void *out, int64_t o_stride, int64_t T,
                              int64_t H, int64_t heads, float eps, int dtype) {
    return run_rmsnorm(rmsnorm_rows, x, x_stride, residual, r_stride, res_out, ro_stride, weight,
                       out, o_stride, T, H, heads, eps, dtype);
}


/* out[t, :d] = round(silu(x[t, :d])) * x[t, d:2d] (gelu-free SwiGLU); x rows of 2d. */
AVX512_TARGET static void silu_mul_rows(void *ctx, int64_t t0, int64_t t1) {
    const silu_mul_job *j = ctx;
    const void *x = j->x;
    void *out = j->out;
    const int64_t x_stride = j->x_stride, o_stride = j->o_stride, d = j->d;
    const int dtype = j->dtype;
    const int64_t es = dtype ? 2 : 4;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t t = t0; t < t1; t++) {
        const char *xr = (const char *)x + t * x_stride * es;
        char *orow = (char *)out + t * o_stride * es;
        for (int64_t i = 0; i < d; i += 16) {
            __mmask16 m = tail_mask(d - i);
            __m512 g = load16m(xr + i * es, dtype, m);
            __m512 u = load16m(xr + (d + i) * es, dtype, m);
            __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            if (dtype) s = round_bf16(s);
            store16m(orow + i * es, _mm512_mul_ps(s, u), dtype, m);
        }
    }
}

AVX512_TARGET int sgl_silu_mul(const void *x, int64_t x_stride, void *out, int64_t o_stride,
                               int64_t T, int64_t d, int dtype) {
    return run_silu_mul(silu_mul_rows, x, x_stride, out, o_stride, T, d, dtype);
}

/* Rotate-half rotary on the first `rot` features of each of H heads of x [T, H, D] (row stride
   x_stride, head stride D) into out [T, H, D] (contiguous): out = x * c + rotate_half(x) * s with
   c = cos | cos and s = -sin | sin given as rows of `rot` values in the dtype (cs rows: c then
   s, 2 * rot values, row stride cs_stride): token t uses row pos[t] of the cs_rows rows, or row t
   when pos is NULL. Features past `rot` are copied. -1: bad rot; -2: a position outside cs. */
AVX512_TARGET static void rotary_rows(void *ctx, int64_t t0, int64_t t1) {
    const rotary_job *j = ctx;
    const void *x = j->x, *cs = j->cs;
    const int64_t *pos = j->pos;
    void *out = j->out;
    const int64_t x_stride = j->x_stride, cs_stride = j->cs_stride, H = j->H, D = j->D,
                  rot = j->rot;
    const int dtype = j->dtype;
    const int64_t es = dtype ? 2 : 4, half = rot / 2;
    for (int64_t t = t0; t < t1; t++) {
        const char *c = (const char *)cs + (pos ? pos[t] : t) * cs_stride * es;
        const char *sn = c + rot * es;
        for (int64_t h = 0; h < H; h++) {
            const char *xr = (const char *)x + (t * x_stride + h * D) * es;
            char *orow = (char *)out + (t * H + h) * D * es;
            for (int64_t i = 0; i < rot; i += 16) {
                __mmask16 m = tail_mask(rot - i);
                /* rotate_half(x)[i] = x[i + half] for i < half, x[i - half] after */
                int64_t j = i < half ? i + half : i - half;
                __mmask16 m1 = m;
                if (i < half && i + 16 > half) m1 = tail_mask(half - i); /* straddles the halves */
                __m512 v = load16m(xr + i * es, dtype, m);
                __m512 r = load16m(xr + j * es, dtype, m1);
                if (m1 != m) { /* lanes past the first half take x[i - half] */
                    __mmask16 m2 = (__mmask16)(m & ~m1);
                    __m512 r2 = load16m(xr + (i - half) * es, dtype, m);
                    r = _mm512_mask_mov_ps(r, m2, r2);
                }
                __m512 a = _mm512_mul_ps(v, load16m(c + i * es, dtype, m));
                __m512 b = _mm512_mul_ps(r, load16m(sn + i * es, dtype, m));
                if (dtype) { a = round_bf16(a); b = round_bf16(b); }
                store16m(orow + i * es, _mm512_add_ps(a, b), dtype, m);
            }
            if (rot < D) memcpy(orow + rot * es, xr + rot * es, (size_t)((D - rot) * es));
        }
    }
}

AVX512_TARGET int sgl_rotary(const void *x, int64_t x_stride, const void *cs, int64_t cs_stride,
                             const int64_t *pos, int64_t cs_rows, void *out, int64_t T, int64_t H,
                             int64_t D, int64_t rot, int dtype) {
    return run_rotary(rotary_rows, x, x_stride, cs, cs_stride, pos, cs_rows, out, T, H, D, rot,
                      dtype);
}

/* out[b] = the first index of the maximum of row b of x [B, V] (float32; NaN counts as the
   maximum, as in torch). */
AVX512_TARGET int sgl_argmax_f32(const float *x, int64_t stride, int64_t B, int64_t V,
                                 int64_t *out) {
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * stride;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        int64_t i = 0;
        for (; i + 16 <= V && !nan; i += 16) {
            __m512 v = _mm512_loadu_ps(r + i);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        if (nan) { /* the first NaN */
            int64_t k = i - 16;
            while (r[k] == r[k]) k++;
            out[b] = k;
            continue;
        }
        float m = _mm512_reduce_max_ps(mx);
        int64_t best = -1;
        for (; i < V; i++) {
            if (r[i] != r[i]) { best = i; break; }
            if (r[i] > m) m = r[i];
        }
        if (best >= 0) {
            /* a NaN in the tail; an earlier one was ruled out above */
            out[b] = best;
            continue;
        }
        __m512 mv = _mm512_set1_ps(m);
        for (i = 0; i + 16 <= V; i += 16) {
            __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), mv, _CMP_EQ_OQ);
            if (eq) { best = i + __builtin_ctz(eq); break; }
        }
        if (best < 0)
            for (; i < V; i++) if (r[i] == m) { best = i; break; }
        out[b] = best < 0 ? 0 : best;
    }
    return 0;
}


/* -- bfloat16 linear without AMX ---------------------------------------------------------------
 * The same product and the same packed weight as sgl_linear_bf16_amx, on AVX-512 vectors: in a
 * 32-wide K block of the packed copy, half h holds 16 pairs of K values for each of 16 columns,
 * so one 64-byte row of it is the 16 columns' weights at K pair p, which multiply the pair
 * x[r, 2p:2p+2] broadcast to every lane. With AVX512-BF16 one vdpbf16ps does the two products
 * and their sum (exact products, fp32 sums, as oneDNN); without it the pairs are widened to fp32
 * and multiplied with two FMAs (below). Up to 8 rows of x share each 32-column panel in
 * registers; more rows read the panel again from cache. x is padded to Kp columns in scratch
 * when K % 32 != 0 (the padding of the weight is zero, but x's memory past K need not be). */

#define BF16_PANEL_ROWS 8

/* acc[r][0..1] for `rows` (constant) rows over one 32-column panel `w` ([KB][2][16][16][2]).
   pf: pf_lines (<= 32) lines of every K block of the next panel, from pf on, to prefetch into L2
   meanwhile; NULL: prefetch this panel's own blocks PREFETCH_BLOCKS ahead into L1 instead. */
#define BF16_PANEL(NAME, TARGET, STEP)                                                          \
    TARGET static inline __attribute__((always_inline)) void NAME(                              \
        const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy, int64_t KB, \
        const float *bias, __mmask16 m0, __mmask16 m1, const char *pf, int64_t pf_lines,       \
        const int rows) {                                                                       \
        __m512 acc[BF16_PANEL_ROWS][2];                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {                                \
            acc[r][0] = _mm512_setzero_ps();                                                    \
            acc[r][1] = _mm512_setzero_ps();                                                    \
        }                                                                                       \
        for (int64_t kb = 0; kb < KB; kb++) {                                                   \
            const uint16_t *wb = w + kb * 1024;                                                 \
            if (!pf) {                                                                          \
                _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024), _MM_HINT_T0);         \
                _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024) + 1024, _MM_HINT_T0);  \
            }                                                                                   \
            for (int p = 0; p < 16; p++) {                                                      \
                const __m512i w0 = _mm512_load_si512(wb + p * 32);                              \
                const __m512i w1 = _mm512_load_si512(wb + 512 + p * 32);                        \
                if (pf) {                                                                       \
                    prefetch_panel_share(pf, pf_lines, kb, p);                                  \
                } else if ((p & 1) == 0) {                                                      \
                    _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024) + p * 64, _MM_HINT_T0); \
                    _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024) + 1024 + p * 64,   \
                                 _MM_HINT_T0);                                                  \
                }                                                                               \
                _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {                        \
                    uint32_t pair;                                                              \
                    memcpy(&pair, x + r * ldx + kb * 32 + 2 * p, 4);                            \
                    const __m512i xv = _mm512_set1_epi32((int)pair);                            \
                    STEP(acc[r][0], xv, w0);                                                    \
                    STEP(acc[r][1], xv, w1);                                                    \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();         \
        const __m512 b1 = bias && m1 ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps(); \
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {                                \
            store16m(y + r * ldy, _mm512_add_ps(acc[r][0], b0), 1, m0);                         \
            if (m1) store16m(y + r * ldy + 16, _mm512_add_ps(acc[r][1], b1), 1, m1);            \
        }                                                                                       \
    }

#define STEP_DP(acc, xv, wv) ((acc) = _mm512_dpbf16_ps((acc), (__m512bh)(xv), (__m512bh)(wv)))
BF16_PANEL(bf16_panel_dp, AVX512_BF16_TARGET, STEP_DP)

/* column panels [np_begin, np_end), rows in groups of BF16_PANEL_ROWS; `a` is x padded to Kp.
   While a panel's row groups run, they prefetch the next panel into L2 (past the range too: the thread's next claim most
   likely begins there, jobs.h panel_chunk), each group
   its share of every K block's lines: read from memory only by the first group of rows, a panel
   left that group memory-bound and the others compute-bound, and a decode step's matmuls read
   their weights at 8-10 GB/s where the memory gives 15-20 (docs/benchmarks.md, "Matmul weights
   from memory"). */
#define BF16_PANELS(NAME, TARGET, PANEL)                                                        \
    TARGET static void NAME(void *ctx, int64_t np_begin, int64_t np_end) {                      \
        const linear_job *j = ctx;                                                              \
        const int64_t KB = ((j->K + 31) & ~(int64_t)31) / 32;                                   \
        const int64_t G = (j->M + BF16_PANEL_ROWS - 1) / BF16_PANEL_ROWS;                       \
        for (int64_t np = np_begin; np < np_end; np++) {                                        \
            const uint16_t *w = j->wp + np * KB * 1024;                                         \
            const char *next = np + 1 < (j->N + 31) / 32 ? (const char *)(w + KB * 1024) : NULL; \
            const int64_t n0 = np * 32;                                                         \
            const __mmask16 m0 = tail_mask(j->N - n0);                                          \
            const __mmask16 m1 = j->N - n0 > 16 ? tail_mask(j->N - n0 - 16) : 0;                \
            const float *b = j->bias ? j->bias + n0 : NULL;                                     \
            for (int64_t r0 = 0, g = 0; r0 < j->M; r0 += BF16_PANEL_ROWS, g++) {                \
                const uint16_t *xr = j->a + r0 * j->lda;                                        \
                uint16_t *yr = j->y + r0 * j->ldy + n0;                                         \
                const int64_t left = j->M - r0;                                                 \
                int64_t pl;                                                                     \
                const char *pf = next_panel_share(next, G, g, &pl);                             \
                switch (left < BF16_PANEL_ROWS ? left : BF16_PANEL_ROWS) {                      \
                case 8: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 8); break;      \
                case 7: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 7); break;      \
                case 6: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 6); break;      \
                case 5: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 5); break;      \
                case 4: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 4); break;      \
                case 3: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 3); break;      \
                case 2: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 2); break;      \
                default: PANEL(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 1);            \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

BF16_PANELS(linear_bf16_dp_range, AVX512_BF16_TARGET, bf16_panel_dp)

/* Without AVX512-BF16: x is widened to fp32 once per call (xf, Kp columns, zero-padded), each
   64-byte row of the weight is split into its even and odd K values as fp32 (lane i of a pair
   holds (even, odd): even << 16 and odd & 0xffff0000 are their fp32 values), and every row of x
   takes two FMAs per column vector and K pair, its two x values broadcast from memory. */
AVX512_TARGET static inline __attribute__((always_inline)) void bf16_panel_widen(
    const float *xf, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy, int64_t KB,
    const float *bias, __mmask16 m0, __mmask16 m1, const char *pf, int64_t pf_lines,
    const int rows) {
    __m512 acc[BF16_PANEL_ROWS][2];
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint16_t *wb = w + kb * 1024;
        for (int p = 0; p < 16; p++) {
            const __m512i w0 = _mm512_load_si512(wb + p * 32), w1 = _mm512_load_si512(wb + 512 + p * 32);
            if (pf) {
                prefetch_panel_share(pf, pf_lines, kb, p);
            } else if ((p & 1) == 0) {
                _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024) + p * 64, _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024) + 1024 + p * 64, _MM_HINT_T0);
            }
            const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
            const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));
            const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
            const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const float *xr = xf + r * ldx + kb * 32 + 2 * p;
                const __m512 xe = _mm512_set1_ps(xr[0]), xo = _mm512_set1_ps(xr[1]);
                acc[r][0] = _mm512_fmadd_ps(xo, w0o, _mm512_fmadd_ps(xe, w0e, acc[r][0]));
                acc[r][1] = _mm512_fmadd_ps(xo, w1o, _mm512_fmadd_ps(xe, w1e, acc[r][1]));
            }
        }
    }
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias && m1 ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        store16m(y + r * ldy, _mm512_add_ps(acc[r][0], b0), 1, m0);
        if (m1) store16m(y + r * ldy + 16, _mm512_add_ps(acc[r][1], b1), 1, m1);
    }
}

AVX512_TARGET static void linear_bf16_widen_range(void *ctx, int64_t np_begin, int64_t np_end) {
    const linear_job *j = ctx;
    const int64_t KB = ((j->K + 31) & ~(int64_t)31) / 32;
    const int64_t G = (j->M + BF16_PANEL_ROWS - 1) / BF16_PANEL_ROWS;
    for (int64_t np = np_begin; np < np_end; np++) {
        const uint16_t *w = j->wp + np * KB * 1024;
        const char *next = np + 1 < (j->N + 31) / 32 ? (const char *)(w + KB * 1024) : NULL;
        const int64_t n0 = np * 32;
        const __mmask16 m0 = tail_mask(j->N - n0), m1 = j->N - n0 > 16 ? tail_mask(j->N - n0 - 16) : 0;
        const float *b = j->bias ? j->bias + n0 : NULL;
        for (int64_t r0 = 0, g = 0; r0 < j->M; r0 += BF16_PANEL_ROWS, g++) {
            const float *xr = j->xf + r0 * j->lda;
            uint16_t *yr = j->y + r0 * j->ldy + n0;
            const int64_t left = j->M - r0;
            int64_t pl;
            const char *pf = next_panel_share(next, G, g, &pl);
            switch (left < BF16_PANEL_ROWS ? left : BF16_PANEL_ROWS) {
            case 8: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 8); break;
            case 7: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 7); break;
            case 6: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 6); break;
            case 5: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 5); break;
            case 4: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 4); break;
            case 3: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 3); break;
            case 2: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 2); break;
            default: bf16_panel_widen(xr, j->lda, w, yr, j->ldy, KB, b, m0, m1, pf, pl, 1);
            }
        }
    }
}

/* x [M, K] bfloat16 -> fp32 [M, Kp] in the caller's scratch, zero past K; NULL without memory */
AVX512_TARGET static const float *widened_x(const uint16_t *x, int64_t ldx, int64_t M, int64_t K) {
    const int64_t Kp = (K + 31) & ~(int64_t)31;
    float *xf = scratch_f32(M * Kp);
    if (!xf) return NULL;
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k < Kp; k += 16) {
            const __mmask16 m = k < K ? tail_mask(K - k) : 0;
            _mm512_storeu_ps(xf + r * Kp + k, load16m(x + r * ldx + k, 1, m));
        }
    return xf;
}

/* x padded to Kp columns (scratch) when K is not a multiple of 32; NULL without memory */
static const uint16_t *padded_k(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                                int64_t *lda) {
    const int64_t Kp = (K + 31) & ~(int64_t)31;
    *lda = ldx;
    if (Kp == K) return x;
    uint16_t *s = scratch_bf16(M * Kp);
    if (!s) return NULL;
    for (int64_t r = 0; r < M; r++) {
        memcpy(s + r * Kp, x + r * ldx, (size_t)(K * 2));
        memset(s + r * Kp + K, 0, (size_t)((Kp - K) * 2));
    }
    *lda = Kp;
    return s;
}

/* dp: 1 with AVX512-BF16 (vdpbf16ps), 0 on plain AVX-512. Same arguments and packed weight as
   sgl_linear_bf16_amx; the column panels are shared out over the kernel threads. */
AVX512_TARGET int sgl_linear_bf16_avx512(const uint16_t *x, int64_t ldx, const uint16_t *wp,
                                         uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                                         const float *bias, int dp) {
    const int64_t NP = (N + 31) / 32;
    const int64_t chunk = panel_chunk(NP);
    if (dp) {
        int64_t lda;
        const uint16_t *a = padded_k(x, ldx, M, K, &lda);
        if (!a) return -1;
        linear_job job = {a, wp, y, lda, ldy, M, N, K, bias, NULL};
        sgl_parallel_for(linear_bf16_dp_range, &job, NP, chunk);
    } else {
        const float *xf = widened_x(x, ldx, M, K);
        if (!xf) return -1;
        linear_job job = {NULL, wp, y, (K + 31) & ~(int64_t)31, ldy, M, N, K, bias, xf};
        sgl_parallel_for(linear_bf16_widen_range, &job, NP, chunk);
    }
    return 0;
}

/* One 32-column panel of the product, on the calling thread: y[M, cols] = x . W^T (+ bias) for
   a panel in the packed layout above ([K/32][2][16][16][2]; the quantized matmuls widen their
   blocks into one, kernels_quant_avx512.c). dp: x (row stride ldx, K a multiple of 32) through
   vdpbf16ps; else xf, x widened to fp32 (row stride ldxf). */
AVX512_TARGET void sgl_bf16_panel_avx512(const uint16_t *x, int64_t ldx, const float *xf,
                                         int64_t ldxf, const uint16_t *panel, uint16_t *y,
                                         int64_t ldy, int64_t M, int64_t cols, int64_t K,
                                         const float *bias, int dp) {
    linear_job job = {x, panel, y, dp ? ldx : ldxf, ldy, M, cols, K, bias, xf};
    if (dp) linear_bf16_dp_range(&job, 0, 1);
    else linear_bf16_widen_range(&job, 0, 1);
}

/* -- paged extend (prefill) attention ---------------------------------------------------------
 * Sequence b has prefix_lens[b] cached tokens and extend_lens[b] new ones, whose queries are the
 * rows q_starts[b] .. + extend_lens[b] of q; the keys and values of all of them (the new ones
 * already written) are the pool rows table[rows[b]][0 .. prefix + extend). New token i sits at
 * position p = prefix + i and attends positions [start(p), p] (causal; start(p) = p - window + 1
 * with a window, else 0). With tree_bits (a token tree of at most 32 new tokens), row i also sees
 * new token j only where bit j of tree_bits[q row of i] is set (its ancestors and itself).
 *
 * Flash-style, in float32: a work item is one tile of QT query tokens of one sequence and one KV
 * head, i.e. R = G * QT <= 64 query rows (the G query heads that share the KV head), which walk
 * the keys in blocks of EXT_KB with an online softmax. The rows lie in the lanes: the item keeps
 * its queries transposed (qt [D][64]), the scores of a block as st [key][64], the output as
 * ot [Dv][64], so the score, softmax and output steps are all vertical vector operations (no
 * horizontal sums, no scalar loops per key) and each key or value element is one broadcast
 * operand of 1-4 FMAs over 16-64 rows. Items are shared out over the kernel threads. */

/* st[x][16 rb ..] = sum_d k_x[d] qt[d][16 rb ..] for keys x0 .. x0 + nx (nx <= 4) and rb < nb
 * (<= 4) row vectors: nx * nb accumulators, one broadcast key element per nb FMAs */
AVX512_TARGET static inline __attribute__((always_inline)) void ext_qk(
    const float *const *k, int64_t D, const float *qt, float *st, const int nx, const int nb) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < nx; x++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) acc[x][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 qv[4];
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) qv[b] = _mm512_load_ps(qt + d * EXT_ROWS + 16 * b);
#pragma GCC unroll 4
        for (int x = 0; x < nx; x++) {
            const __m512 kv = _mm512_set1_ps(k[x][d]);
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++) acc[x][b] = _mm512_fmadd_ps(kv, qv[b], acc[x][b]);
        }
    }
#pragma GCC unroll 4
    for (int x = 0; x < nx; x++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) _mm512_store_ps(st + x * EXT_ROWS + 16 * b, acc[x][b]);
}

/* ot[c][16 rb ..] += sum_x v_x[c] pt[x][16 rb ..] for columns c0 .. c0 + nc (nc <= 4) */
AVX512_TARGET static inline __attribute__((always_inline)) void ext_pv(
    const float *const *v, int64_t nk, const float *pt, float *ot, int64_t c0, const int nc,
    const int nb) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int c = 0; c < nc; c++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) acc[c][b] = _mm512_load_ps(ot + (c0 + c) * EXT_ROWS + 16 * b);
    for (int64_t x = 0; x < nk; x++) {
        __m512 pv[4];
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) pv[b] = _mm512_load_ps(pt + x * EXT_ROWS + 16 * b);
#pragma GCC unroll 4
        for (int c = 0; c < nc; c++) {
            const __m512 vv = _mm512_set1_ps(v[x][c0 + c]);
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++) acc[c][b] = _mm512_fmadd_ps(vv, pv[b], acc[c][b]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < nc; c++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) _mm512_store_ps(ot + (c0 + c) * EXT_ROWS + 16 * b, acc[c][b]);
}

/* ext_qk with AVX512-BF16 dot products for bfloat16: qt2 [D/2][64] holds each row's query as
   bfloat16 pairs, each key pair k_x[2p], k_x[2p + 1] is one 32-bit broadcast from the pool's row
   (no widening), and one vdpbf16ps multiplies it with 16 rows' pairs (exact products, float32
   sums, as the decode kernel's qk_dp); the scores are scaled at the end. */
AVX512_BF16_TARGET static inline __attribute__((always_inline)) void ext_qk_dp(
    const char *const *k, int64_t D, const uint32_t *qt2, float *st, float scale, const int nx,
    const int nb) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < nx; x++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) acc[x][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        __m512i qv[4];
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) qv[b] = _mm512_load_si512(qt2 + p * EXT_ROWS + 16 * b);
#pragma GCC unroll 4
        for (int x = 0; x < nx; x++) {
            uint32_t pair;
            memcpy(&pair, k[x] + 4 * p, 4);
            const __m512i kv = _mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++)
                acc[x][b] = _mm512_dpbf16_ps(acc[x][b], (__m512bh)qv[b], (__m512bh)kv);
        }
    }
    const __m512 sv = _mm512_set1_ps(scale);
#pragma GCC unroll 4
    for (int x = 0; x < nx; x++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) _mm512_store_ps(st + x * EXT_ROWS + 16 * b, _mm512_mul_ps(acc[x][b], sv));
}

/* the scores of a block's nk keys (rows of the pool, bfloat16) for nb row vectors */
AVX512_BF16_TARGET static void ext_qk_dp_block(const char *const *k, int64_t nk, int64_t D,
                                               const uint32_t *qt2, float *st, float scale,
                                               int nb) {
    for (int64_t x = 0; x < nk; x += 4) {
        const int64_t nx = nk - x < 4 ? nk - x : 4;
#define EXT_QK_DP(NX, NB) ext_qk_dp(k + x, D, qt2, st + x * EXT_ROWS, scale, NX, NB)
#define EXT_QK_DP_NX(NB)                                                                        \
    switch (nx) {                                                                               \
    case 4: EXT_QK_DP(4, NB); break;                                                            \
    case 3: EXT_QK_DP(3, NB); break;                                                            \
    case 2: EXT_QK_DP(2, NB); break;                                                            \
    default: EXT_QK_DP(1, NB);                                                                  \
    }
        switch (nb) {
        case 4: EXT_QK_DP_NX(4); break;
        case 3: EXT_QK_DP_NX(3); break;
        case 2: EXT_QK_DP_NX(2); break;
        default: EXT_QK_DP_NX(1);
        }
#undef EXT_QK_DP_NX
#undef EXT_QK_DP
    }
}

/* The weighted sum on vdpbf16ps (dp), keys in pairs as in the decode kernel's pv_dp_heads:
   pp[i][r] = the bfloat16 pair (p_2i[r], p_2i+1[r]) of row r's probabilities, vpair[i][q] =
   the pair (v_2i[c], v_2i+1[c]) of column c = ext_dp_column(q), so a row's probabilities are
   rounded to bfloat16 before their products, as transformers' eager attention rounds them. */
static inline int64_t ext_dp_column(int64_t q) { /* positions of vpunpck{l,h}wd's lanes */
    const int64_t chunk = q / 32, r = q % 32, half = r / 16, lane = (r % 16) / 4;
    return chunk * 32 + lane * 8 + half * 4 + r % 4;
}

/* pp and vpair of the block's nk keys (an odd last key pairs with itself, probability 0) */
AVX512_BF16_TARGET static void ext_dp_pairs(const char *const *v, int64_t nk, int64_t Dv,
                                            const float *pt, uint32_t *pp, uint32_t *vpair,
                                            const int nb) {
    for (int64_t x = 0; x < nk; x += 2) {
        const int64_t i = x / 2;
        const char *r1 = v[x + 1 < nk ? x + 1 : x];
        for (int b = 0; b < nb; b++) {
            const __m512 a = _mm512_load_ps(pt + x * EXT_ROWS + 16 * b);
            const __m512 c = x + 1 < nk ? _mm512_load_ps(pt + (x + 1) * EXT_ROWS + 16 * b)
                                        : _mm512_setzero_ps();
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(c));
            _mm512_storeu_si512(pp + i * EXT_ROWS + 16 * b,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        for (int64_t c0 = 0; c0 < Dv; c0 += 32) {
            const __m512i x0 = _mm512_loadu_si512(v[x] + c0 * 2), x1 = _mm512_loadu_si512(r1 + c0 * 2);
            _mm512_storeu_si512(vpair + i * Dv + c0, _mm512_unpacklo_epi16(x0, x1));
            _mm512_storeu_si512(vpair + i * Dv + c0 + 16, _mm512_unpackhi_epi16(x0, x1));
        }
    }
}

/* ot[c][rows] += the block's weighted V for the 4 columns of positions q0 .. q0 + 3 */
AVX512_BF16_TARGET static inline __attribute__((always_inline)) void ext_pv_dp(
    const uint32_t *vpair, int64_t np, int64_t Dv, const uint32_t *pp, float *ot, int64_t q0,
    const int nb) {
    const int64_t c0 = ext_dp_column(q0); /* 4 positions, 4 consecutive columns */
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) acc[c][b] = _mm512_load_ps(ot + (c0 + c) * EXT_ROWS + 16 * b);
    for (int64_t i = 0; i < np; i++) {
        __m512bh pv[4];
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) pv[b] = (__m512bh)_mm512_loadu_si512(pp + i * EXT_ROWS + 16 * b);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)vpair[i * Dv + q0 + c]);
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++) acc[c][b] = _mm512_dpbf16_ps(acc[c][b], pv[b], w);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++)
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) _mm512_store_ps(ot + (c0 + c) * EXT_ROWS + 16 * b, acc[c][b]);
}

AVX512_BF16_TARGET static void ext_pv_dp_block(const uint32_t *vpair, int64_t np, int64_t Dv,
                                               const uint32_t *pp, float *ot, int nb) {
    for (int64_t q0 = 0; q0 < Dv; q0 += 4) {
#define EXT_PV_DP(NB) ext_pv_dp(vpair, np, Dv, pp, ot, q0, NB)
        switch (nb) {
        case 4: EXT_PV_DP(4); break;
        case 3: EXT_PV_DP(3); break;
        case 2: EXT_PV_DP(2); break;
        default: EXT_PV_DP(1);
        }
#undef EXT_PV_DP
    }
}

#define EXT_NB_SWITCH(CALL, NB)                                                                 \
    switch (NB) {                                                                               \
    case 4: CALL(4); break;                                                                     \
    case 3: CALL(3); break;                                                                     \
    case 2: CALL(2); break;                                                                     \
    default: CALL(1);                                                                           \
    }

AVX512_TARGET static void extend_attention_items(void *ctx, int64_t i0, int64_t i1) {
    extend_job *j = ctx;
    const int64_t D = j->D, Dv = j->Dv, es = j->es;
    extend_buffers buf; /* per thread */
    if (extend_buffers_get(j, &buf)) {
        atomic_store(&j->failed, 1);
        return;
    }
    float *qt = buf.qt, *st = buf.st, *ot = buf.ot, *kf = buf.kf, *vf = buf.vf;
    float *mrow = buf.mrow, *lrow = buf.lrow;
    const int32_t *pos = buf.pos, *tbits = j->tree_bits ? buf.tbits : NULL;
    const float *kx[EXT_KB], *vx[EXT_KB];
    const char *kb[EXT_KB], *vb[EXT_KB]; /* the block's K and V rows in the pool */
    const int pv_dp = j->dp && Dv % 32 == 0 && D >= 32; /* pp fits in kf, vpair in vf */
    for (int64_t item = i0; item < i1; item++) {
        const extend_item it = extend_locate(j, item);
        const int64_t hk = it.hk, rows = it.rows, p_last = it.p_last, *slots = it.slots;
        const int64_t prefix = j->prefix_lens[it.b];
        const int nb = (int)((rows + 15) / 16);
        extend_item_reset(j, &it, &buf);
        if (j->dp) extend_load_query_pairs(j, &it, (uint32_t *)qt);
        else extend_load_queries(j, &it, qt);
        for (int64_t k0 = it.k_begin & ~(int64_t)1, k1; k0 <= p_last; k0 = k1) {
            k1 = (k0 / EXT_KB + 1) * EXT_KB < p_last + 1 ? (k0 / EXT_KB + 1) * EXT_KB : p_last + 1;
            const int64_t nk = k1 - k0; /* blocks end at multiples of EXT_KB (see extend_locate) */
            for (int64_t x = 0; x < nk; x++) {
                const char *kr = j->kp + slots[k0 + x] * j->k_row + hk * D * es;
                const char *vr = j->vp + slots[k0 + x] * j->v_row + hk * Dv * es;
                kb[x] = kr;
                if (j->dtype) { /* widen the block once; float32 is read in place */
                    if (!j->dp) /* dp reads K in place */
                        for (int64_t d = 0; d < D; d += 16)
                            _mm512_store_ps(kf + x * D + d, load16(kr + d * es, 1));
                    if (!pv_dp) /* pv_dp reads V in place too */
                        for (int64_t d = 0; d < Dv; d += 16)
                            _mm512_store_ps(vf + x * Dv + d, load16(vr + d * es, 1));
                    vb[x] = vr;
                    kx[x] = kf + x * D;
                    vx[x] = vf + x * Dv;
                } else {
                    kx[x] = (const float *)kr;
                    vx[x] = (const float *)vr;
                }
            }
            if (j->dp) ext_qk_dp_block(kb, nk, D, (const uint32_t *)qt, st, j->scale, nb);
            else for (int64_t x = 0; x < nk; x += 4) {
                const int64_t nx = nk - x < 4 ? nk - x : 4;
#define EXT_QK(NB)                                                                              \
    switch (nx) {                                                                               \
    case 4: ext_qk(kx + x, D, qt, st + x * EXT_ROWS, 4, NB); break;                             \
    case 3: ext_qk(kx + x, D, qt, st + x * EXT_ROWS, 3, NB); break;                             \
    case 2: ext_qk(kx + x, D, qt, st + x * EXT_ROWS, 2, NB); break;                             \
    default: ext_qk(kx + x, D, qt, st + x * EXT_ROWS, 1, NB);                                   \
    }
                EXT_NB_SWITCH(EXT_QK, nb)
#undef EXT_QK
            }
            /* the online softmax, 16 rows at a time: mask, new maximum, rescale, exponentials */
            for (int rb = 0; rb < nb; rb++) {
                const __m512i p = _mm512_loadu_si512(pos + 16 * rb);
                const __m512i lo = j->window > 0 ? _mm512_sub_epi32(p, _mm512_set1_epi32(
                                                       (int)j->window - 1))
                                                 : _mm512_setzero_si512();
                __m512 mx = _mm512_load_ps(mrow + 16 * rb);
                const __m512 m_old = mx;
                const __m512i seen = tbits ? _mm512_loadu_si512(tbits + 16 * rb)
                                           : _mm512_setzero_si512();
                __mmask16 any = 0;
                for (int64_t x = 0; x < nk; x++) {
                    const __m512i key = _mm512_set1_epi32((int)(k0 + x));
                    __mmask16 ok = _mm512_cmp_epi32_mask(key, p, _MM_CMPINT_LE)
                                   & _mm512_cmp_epi32_mask(key, lo, _MM_CMPINT_NLT);
                    const int64_t jn = k0 + x - prefix; /* the key's index among the new tokens */
                    if (tbits && jn >= 0 && jn < 32)
                        ok &= _mm512_test_epi32_mask(seen, _mm512_set1_epi32((int)(1u << jn)));
                    __m512 s = _mm512_load_ps(st + x * EXT_ROWS + 16 * rb);
                    if (j->softcap > 0) s = softcapped(s, j->softcap);
                    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, s);
                    _mm512_store_ps(st + x * EXT_ROWS + 16 * rb, s);
                    mx = _mm512_max_ps(mx, s);
                    any |= ok;
                }
                if (!any) { /* no row of these 16 sees a key of this block */
                    for (int64_t x = 0; x < nk; x++)
                        _mm512_store_ps(st + x * EXT_ROWS + 16 * rb, _mm512_setzero_ps());
                    continue;
                }
                const __mmask16 live = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                const __m512 m_safe = _mm512_maskz_mov_ps(live, mx); /* -inf rows: 0, all e = 0 */
                const __m512 alpha = _mm512_maskz_mov_ps(
                    _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                    exp_nonpositive(_mm512_sub_ps(m_old, m_safe)));
                __m512 sum = _mm512_mul_ps(_mm512_load_ps(lrow + 16 * rb), alpha);
                for (int64_t x = 0; x < nk; x++) {
                    const __m512 s = _mm512_load_ps(st + x * EXT_ROWS + 16 * rb);
                    const __mmask16 ok = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                    const __m512 e = _mm512_maskz_mov_ps(ok, exp_nonpositive(_mm512_sub_ps(s, m_safe)));
                    _mm512_store_ps(st + x * EXT_ROWS + 16 * rb, e);
                    sum = _mm512_add_ps(sum, e);
                }
                _mm512_store_ps(lrow + 16 * rb, sum);
                _mm512_store_ps(mrow + 16 * rb, mx);
                for (int64_t c = 0; c < Dv; c++)
                    _mm512_store_ps(ot + c * EXT_ROWS + 16 * rb,
                                    _mm512_mul_ps(_mm512_load_ps(ot + c * EXT_ROWS + 16 * rb), alpha));
            }
            if (pv_dp) { /* kf and vf are free: K and V are read in place */
                ext_dp_pairs(vb, nk, Dv, st, (uint32_t *)kf, (uint32_t *)vf, nb);
                ext_pv_dp_block((const uint32_t *)vf, (nk + 1) / 2, Dv, (const uint32_t *)kf, ot, nb);
            } else for (int64_t c = 0; c < Dv; c += 4) {
#define EXT_PV(NB) ext_pv(vx, nk, st, ot, c, 4, NB)
                EXT_NB_SWITCH(EXT_PV, nb)
#undef EXT_PV
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const float inv = lrow[r] > 0 ? 1.0f / lrow[r] : 0.0f;
            char *dst = extend_out_row(j, &it, r);
            float tmp[16];
            for (int64_t c = 0; c < Dv; c += 16) {
                for (int e = 0; e < 16; e++) tmp[e] = ot[(c + e) * EXT_ROWS + r];
                store16(dst + c * es, _mm512_mul_ps(_mm512_loadu_ps(tmp), _mm512_set1_ps(inv)),
                        j->dtype);
            }
        }
    }
}

#undef EXT_NB_SWITCH

AVX512_TARGET int sgl_extend_attention(
    const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int64_t *table,
    int64_t table_stride, const int64_t *rows, const int64_t *q_starts, const int64_t *prefix_lens,
    const int64_t *extend_lens, int64_t B, void *out, int64_t out_stride, int64_t Hq, int64_t Hk,
    int64_t D, int64_t Dv, float scale, float softcap, int64_t window, int dtype, int bf16_dot,
    const int32_t *tree_bits) {
    return run_extend_attention(extend_attention_items, q, q_stride, k_pool, v_pool, table,
                                table_stride, rows, q_starts, prefix_lens, extend_lens, B, out,
                                out_stride, Hq, Hk, D, Dv, scale, softcap, window, dtype, bf16_dot,
                                tree_bits);
}

/* what run_op.c calls at the AVX-512 levels (in the emulated copy: sgl_avx512_kernels_emulated) */
const sgl_avx512_kernels sgl_avx512_kernels_native = {
    sgl_linear_bf16_amx, sgl_linear_bf16_avx512, sgl_linear_f32, sgl_rmsnorm, sgl_silu_mul,
    sgl_rotary, sgl_argmax_f32, sgl_decode_attention, sgl_extend_attention,
    sgl_linear_quant_avx512, sgl_linear_w8a8_avx512,
};

#endif
