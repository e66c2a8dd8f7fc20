/* The int8 matmul of sgl::linear_w8a8 at the AVX-512 levels: AMX int8 tiles for many rows,
 * AVX512-VNNI for few, the AVX2 kernel (kernels_w8a8.c) where the CPU has no VNNI. The
 * arguments, the packed weight and the results (the same bits at every level) are those of
 * kernels_w8a8.c's header.
 *
 * VNNI: up to 4 rows by up to 4 groups of 16 channels; for each 4 values along K, one 64-byte
 * load of each group's packed weight (16 channels x 4 values) and one broadcast dword of each
 * row's int8 x, multiplied and summed by one vpdpbusd per row and group (the weight unsigned,
 * x signed, as the instruction takes them).
 *
 * AMX (from W8A8_AMX_ROWS rows, at the amx level): TDPBSUD with x's rounded rows as the A
 * tiles (16 rows x 64 values, signed) and the packed weight as the B tiles (64 values x 16
 * channels, unsigned) as it lies in memory, so neither is copied; 32 rows by 32 channels per
 * pass (four C tiles), the K loop 64 values at a time. A C tile's rows are rows of y, so the
 * scaling is 16 channels wide, as in the VNNI kernel.
 *
 * The groups of channels are shared out over the pool's threads.
 */
#if defined(SGL_EMULATE_ISA)
#include "isa_emulation.h"

#define W8_VNNI_TARGET
#define W8_AMX_TARGET
#define W8_HAS_VNNI() 1
#elif defined(__x86_64__)
#include <immintrin.h>

#define W8_VNNI_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define W8_AMX_TARGET                                                                     \
    __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni," \
                          "avx2,fma,f16c")))
#define W8_HAS_VNNI() __builtin_cpu_supports("avx512vnni")
#endif

#include "jobs.h"
#include "kernels.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)

/* from this many rows (and a K that is a whole number of 64-value steps after padding, which
   it always is) the AMX tiles */
#define W8A8_AMX_ROWS 5
#define W8_INLINE static inline __attribute__((always_inline))
/* 64-value steps of the weight the AMX tiles ask for ahead of their loads */
#define W8_PREFETCH_STEPS 16

/* y[r, n0 .. n0 + 16) from the 16 channels' int32 sums of row r: (sum - 128 sum(q)) * sx * sw
   (+ bias), rounded to x's dtype (bfloat16: nearest even, in integers, since the VNNI levels
   need not have AVX512-BF16) */
W8_VNNI_TARGET W8_INLINE void w8_store16(const w8a8_job *j, int64_t r, int64_t n0, __m512i sums) {
    const int64_t left = j->N - n0;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, _mm512_set1_epi32(j->xs[r])));
    v = _mm512_mul_ps(v, _mm512_set1_ps(j->sx[r]));
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, j->sw + n0));
    if (j->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, j->bias + n0));
    if (!j->dtype) {
        _mm512_mask_storeu_ps((float *)j->y + r * j->ldy + n0, mask, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i h = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    h = _mm512_mask_mov_epi32(h, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_mask_storeu_epi16((uint16_t *)j->y + r * j->ldy + n0, mask,
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
}

/* -- VNNI: R rows (1-4) by G groups (1-4) of 16 channels -------------------------------------- */

W8_VNNI_TARGET W8_INLINE void w8_tile_vnni(const w8a8_job *j, int64_t m0, int64_t g0,
                                          const int R, const int G) {
    const int64_t Kp = j->Kp;
    const uint8_t *w = j->wp + g0 * Kp * 16;
    const int8_t *xr = j->xq + m0 * j->ldq;
    __m512i acc[4][4];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < Kp / 4; k4++) {
        __m512i wv[4];
        #pragma GCC unroll 4
        for (int g = 0; g < G; g++)
            wv[g] = _mm512_loadu_si512((const void *)(w + g * Kp * 16 + k4 * 64));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t x4;
            memcpy(&x4, xr + r * j->ldq + 4 * k4, 4);
            const __m512i xv = _mm512_set1_epi32(x4);
            #pragma GCC unroll 4
            for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], wv[g], xv);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int g = 0; g < G; g++) w8_store16(j, m0 + r, (g0 + g) * 16, acc[r][g]);
}

#define W8_TILE_CASE(R, G) \
    case (R - 1) * 4 + G - 1: w8_tile_vnni(j, m0, g0, R, G); break;

/* units of 4 groups, every row */
W8_VNNI_TARGET static void w8a8_units_vnni(void *ctx, int64_t begin, int64_t end) {
    const w8a8_job *j = ctx;
    const int64_t groups = (j->N + 15) / 16;
    for (int64_t u = begin; u < end; u++) {
        const int64_t g0 = u * 4;
        const int G = groups - g0 >= 4 ? 4 : (int)(groups - g0);
        for (int64_t m0 = 0; m0 < j->M; m0 += 4) {
            const int R = j->M - m0 >= 4 ? 4 : (int)(j->M - m0);
            switch ((R - 1) * 4 + G - 1) {
            W8_TILE_CASE(1, 1) W8_TILE_CASE(1, 2) W8_TILE_CASE(1, 3) W8_TILE_CASE(1, 4)
            W8_TILE_CASE(2, 1) W8_TILE_CASE(2, 2) W8_TILE_CASE(2, 3) W8_TILE_CASE(2, 4)
            W8_TILE_CASE(3, 1) W8_TILE_CASE(3, 2) W8_TILE_CASE(3, 3) W8_TILE_CASE(3, 4)
            W8_TILE_CASE(4, 1) W8_TILE_CASE(4, 2) W8_TILE_CASE(4, 3) W8_TILE_CASE(4, 4)
            }
        }
    }
}

#undef W8_TILE_CASE

/* -- AMX: 32 rows by 32 channels per pass ----------------------------------------------------- */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} w8_tilecfg;

/* pairs of groups [begin, end), every row */
W8_AMX_TARGET static void w8a8_pairs_amx(void *ctx, int64_t begin, int64_t end) {
    const w8a8_job *j = ctx;
    const int64_t Kp = j->Kp, KB = Kp / 64, groups = (j->N + 15) / 16;
    const int64_t Mp = (j->M + 15) & ~(int64_t)15;
    w8_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    int32_t c[4][256] __attribute__((aligned(64)));
    for (int64_t p = begin; p < end; p++) {
        const int64_t g0 = 2 * p;
        const int two = groups - g0 >= 2; /* a second group of channels */
        const uint8_t *w0 = j->wp + g0 * Kp * 16, *w1 = w0 + Kp * 16;
        for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
            const int both = Mp - m0 >= 32; /* a second tile of rows */
            const int8_t *a0 = j->xq + m0 * j->ldq, *a1 = a0 + 16 * j->ldq;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t kb = 0; kb < KB; kb++) {
                if (m0 == 0 && kb + W8_PREFETCH_STEPS < KB) /* the first pass reads memory */
                    for (int line = 0; line < 16; line++) {
                        _mm_prefetch((const char *)w0 + (kb + W8_PREFETCH_STEPS) * 1024 + 64 * line,
                                     _MM_HINT_T0);
                        if (two)
                            _mm_prefetch((const char *)w1 + (kb + W8_PREFETCH_STEPS) * 1024 +
                                         64 * line, _MM_HINT_T0);
                    }
                _tile_loadd(6, w0 + kb * 1024, 64);
                _tile_loadd(4, a0 + kb * 64, j->ldq);
                _tile_dpbsud(0, 4, 6);
                if (two) {
                    _tile_loadd(7, w1 + kb * 1024, 64);
                    _tile_dpbsud(1, 4, 7);
                }
                if (both) {
                    _tile_loadd(5, a1 + kb * 64, j->ldq);
                    _tile_dpbsud(2, 5, 6);
                    if (two) _tile_dpbsud(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            if (two) _tile_stored(1, c[1], 64);
            if (both) {
                _tile_stored(2, c[2], 64);
                if (two) _tile_stored(3, c[3], 64);
            }
            for (int half = 0; half < 1 + both; half++)
                for (int r = 0; r < 16 && m0 + 16 * half + r < j->M; r++)
                    for (int g = 0; g < 1 + two; g++)
                        w8_store16(j, m0 + 16 * half + r, (g0 + g) * 16,
                                   _mm512_load_si512((const void *)(c[2 * half + g] + 16 * r)));
        }
    }
    _tile_release();
}

W8_VNNI_TARGET int sgl_linear_w8a8_avx512(const void *x, int64_t ldx, const uint8_t *wp,
                                          const float *sw, void *y, int64_t ldy, int64_t M,
                                          int64_t N, int64_t K, const float *bias, int dtype,
                                          int amx) {
    if (!W8_HAS_VNNI())
        return sgl_linear_w8a8_avx2(x, ldx, wp, sw, y, ldy, M, N, K, bias, dtype);
    w8a8_job job;
    const int rc = w8a8_setup(&job, x, ldx, wp, sw, y, ldy, M, N, K, bias, dtype);
    if (rc) return rc;
    const int64_t groups = (N + 15) / 16;
    if (amx && M >= W8A8_AMX_ROWS) {
        const int64_t pairs = (groups + 1) / 2;
        sgl_parallel_for(w8a8_pairs_amx, &job, pairs, chunk_of(pairs));
    } else {
        const int64_t units = (groups + 3) / 4;
        sgl_parallel_for(w8a8_units_vnni, &job, units, chunk_of(units));
    }
    return 0;
}

#endif
