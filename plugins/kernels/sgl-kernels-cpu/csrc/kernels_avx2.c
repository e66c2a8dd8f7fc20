/* sgl's CPU kernels at the AVX2 level (AVX2 + FMA, no AVX-512: Intel Haswell to Comet Lake and
 * Alder Lake's cores, AMD Zen 1-3).
 *
 * The kernels of kernels_avx512.c on 8-lane vectors, with the same arguments, return codes,
 * packed weights and rounding (bfloat16 results rounded to nearest even wherever torch rounds),
 * and the same split over the pool's threads. AVX2 has no masked loads for 16-bit values, so a
 * row's last partial vector goes through a small zero-padded buffer (load8n / store8n). Its exp
 * flushes results below FLT_MIN (x < -87.34) to zero, where the AVX-512 one keeps denormals.
 * bfloat16 has no arithmetic here: it is widened to fp32 on load (a 16-bit shift) and rounded
 * back on store.
 */
#include "jobs.h"
#include "kernels.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

#include "vec_avx2.h"

#define PREFETCH_BLOCKS 4 /* K blocks of a bfloat16 panel (2 KiB each) prefetched ahead */

/* -- float32 linear -------------------------------------------------------------------------
 * y[M, N] = x[M, K] . W^T (+ bias) on the packed panels of sgl_linear_f32 ([Np/32][K][32]).
 * Up to two rows (decode) take a whole 32-column panel row per K step: 8 sums, 4 weights and the
 * broadcast x in 13 of the 16 registers. More rows go in tiles of 6 rows x 16 columns (12 sums,
 * 2 weights, one broadcast: the shape of BLIS's AVX2 kernel) over blocks of F32_KC K steps, so
 * that the block of the panel (16 KiB) stays in L1 while every row tile reads it; the partial
 * sums are kept in y between blocks. */

#define F32_KC 256 /* K steps per block of a panel: 16 KiB of each 16-column half */
#define F32_TILE_ROWS 6

/* Prefetching: with more than two rows, while a panel is multiplied, the next panel of the
   thread's range streams into L2 (as in kernels_avx512.c's BF16_PANELS): each row tile its share
   of the next panel's rows in the same K block, one every `every` of its own steps (pf NULL:
   none). One or two rows read the panel in one sequential pass, which the hardware's
   prefetchers keep at memory speed; prefetching there measured slower. */
AVX2_TARGET INLINE void f32_rows(const float *x, int64_t ldx, const float *w, float *y,
                                 int64_t ldy, int64_t K, const float *bias, int64_t cols,
                                 const int rows) {
    __m256 acc[2][4];
    #pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * 32;
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        const __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(xv, w3, acc[r][3]);
        }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < 4; c++) {
        if (8 * c >= cols) continue; /* a constant count keeps the sums in registers */
        const __m256 b = bias ? load8n(bias + 8 * c, cols - 8 * c, 0) : _mm256_setzero_ps();
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
            store8n(y + r * ldy + 8 * c, _mm256_add_ps(acc[r][c], b), cols - 8 * c, 0);
    }
}

/* y[r, :cols] (cols <= 16) of `rows` rows += x[r, k0 .. k0 + kc] . w over one K block; `first`:
   y starts from zero, `bias` (or NULL) is added on the last block */
AVX2_TARGET INLINE void f32_tile(const float *x, int64_t ldx, const float *w, float *y,
                                 int64_t ldy, int64_t kc, const float *bias, int64_t cols,
                                 int first, const float *pf, int64_t every, const int rows) {
    __m256 acc[F32_TILE_ROWS][2];
    #pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < 2; c++)
            acc[r][c] = first ? _mm256_setzero_ps() : load8n(y + r * ldy + 8 * c, cols - 8 * c, 0);
    for (int64_t k = 0, due = 0; k < kc; k++) {
        if (pf && --due <= 0) {
            prefetch_l2((const char *)pf, 32 * sizeof(float));
            pf += 32;
            due = every;
        }
        const __m256 w0 = _mm256_loadu_ps(w + k * 32), w1 = _mm256_loadu_ps(w + k * 32 + 8);
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < 2; c++) {
        if (8 * c >= cols) continue; /* a constant count keeps the sums in registers */
        const __m256 b = bias ? load8n(bias + 8 * c, cols - 8 * c, 0) : _mm256_setzero_ps();
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
            store8n(y + r * ldy + 8 * c, _mm256_add_ps(acc[r][c], b), cols - 8 * c, 0);
    }
}

AVX2_TARGET static void linear_f32_panels(void *ctx, int64_t np_begin, int64_t np_end) {
    const linear_f32_job *j = ctx;
    const int64_t M = j->M, K = j->K, ldx = j->ldx, ldy = j->ldy;
    /* row tiles per K block, each run on both 16-column halves */
    const int64_t tiles = 2 * ((M + F32_TILE_ROWS - 1) / F32_TILE_ROWS);
    for (int64_t np = np_begin; np < np_end; np++) {
        const float *w = j->wp + np * K * 32;
        const float *next = np + 1 < (j->N + 31) / 32 ? w + K * 32 : NULL;
        const int64_t n0 = np * 32, cols = j->N - n0 < 32 ? j->N - n0 : 32;
        const float *b = j->bias ? j->bias + n0 : NULL;
        if (M <= 2) {
            if (M == 2) f32_rows(j->x, ldx, w, j->y + n0, ldy, K, b, cols, 2);
            else f32_rows(j->x, ldx, w, j->y + n0, ldy, K, b, cols, 1);
            continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += F32_KC) {
            const int64_t kc = K - k0 < F32_KC ? K - k0 : F32_KC;
            const int64_t span = (kc + tiles - 1) / tiles; /* next-panel rows per tile */
            const int first = k0 == 0;
            const float *bk = k0 + kc == K ? b : NULL;
            for (int64_t r0 = 0, t = 0; r0 < M; r0 += F32_TILE_ROWS) {
                const float *xr = j->x + r0 * ldx + k0;
                for (int64_t h = 0; h < 2 && 16 * h < cols; h++, t++) {
                    const float *wh = w + k0 * 32 + 16 * h;
                    float *yr = j->y + r0 * ldy + n0 + 16 * h;
                    const int64_t ch = cols - 16 * h < 16 ? cols - 16 * h : 16;
                    const float *bh = bk ? bk + 16 * h : NULL;
                    const float *pf = next && t * span < kc ? next + (k0 + t * span) * 32 : NULL;
                    switch (M - r0 < F32_TILE_ROWS ? M - r0 : F32_TILE_ROWS) {
                    case 6: f32_tile(xr, ldx, wh, yr, ldy, kc, bh, ch, first, pf, tiles, 6); break;
                    case 5: f32_tile(xr, ldx, wh, yr, ldy, kc, bh, ch, first, pf, tiles, 5); break;
                    case 4: f32_tile(xr, ldx, wh, yr, ldy, kc, bh, ch, first, pf, tiles, 4); break;
                    case 3: f32_tile(xr, ldx, wh, yr, ldy, kc, bh, ch, first, pf, tiles, 3); break;
                    case 2: f32_tile(xr, ldx, wh, yr, ldy, kc, bh, ch, first, pf, tiles, 2); break;
                    default: f32_tile(xr, ldx, wh, yr, ldy, kc, bh, ch, first, pf, tiles, 1);
                    }
                }
            }
        }
    }
}

/* y[M, cols] (row stride ldy) = x [M, K] . W^T (+ bias) for one panel [K][32] of W^T (cols <=
   32 of its columns), on the calling thread: the quantized matmul's path for many rows */
AVX2_TARGET void sgl_f32_panel_avx2(const float *x, int64_t ldx, const float *panel, float *y,
                                    int64_t ldy, int64_t M, int64_t cols, int64_t K,
                                    const float *bias) {
    linear_f32_job job = {x, panel, bias, y, ldx, ldy, M, cols, K};
    linear_f32_panels(&job, 0, 1);
}

AVX2_TARGET int sgl_linear_f32_avx2(const float *x, int64_t ldx, const float *wp, float *y,
                                    int64_t ldy, int64_t M, int64_t N, int64_t K,
                                    const float *bias) {
    return run_linear_f32(linear_f32_panels, x, ldx, wp, y, ldy, M, N, K, bias);
}

/* -- bfloat16 linear --------------------------------------------------------------------------
 * The product of sgl_linear_bf16_amx on its packed weight, as kernels_avx512.c's widened kernel
 * computes it: x is widened to fp32 once per call (Kp columns, zero past K); in a 32-wide K block
 * of the weight, half h (columns 16h .. 16h + 15) holds at row p the 16 columns' values at K pair
 * p, (even, odd) in each 32-bit lane, so one 32-byte load gives 8 columns' even values (<< 16)
 * and odd ones (& 0xffff0000) as fp32, which two FMAs multiply by x's pair. Two rows of x at a
 * time: 8 sums, 2 x 2 broadcasts, and the two widened weights. */

typedef struct {
    const float *xf;
    const uint16_t *wp;
    uint16_t *y;
    int64_t ldx, ldy, M, N, K;
    const float *bias;
} linear_bf16_job;

/* pf: pf_lines (<= 32) lines of every K block of the next panel, from pf on, to prefetch into
   L2 meanwhile (kernels_avx512.c's BF16_PANELS); NULL: this panel's own blocks
   PREFETCH_BLOCKS ahead into L1 */
AVX2_TARGET INLINE void bf16_rows(const float *xf, int64_t ldx, const uint16_t *w, uint16_t *y,
                                  int64_t ldy, int64_t KB, const float *bias, int64_t cols,
                                  const char *pf, int64_t pf_lines, const int rows) {
    __m256 acc[2][4];
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    #pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        #pragma GCC unroll 8
        for (int g = 0; g < 4; g++) acc[r][g] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint16_t *wb = w + kb * 1024;
        for (int p = 0; p < 16; p++) {
            if (pf) {
                prefetch_panel_share(pf, pf_lines, kb, p);
            } else if ((p & 3) == 0) {
                _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024) + p * 64, _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + PREFETCH_BLOCKS * 1024) + 1024 + p * 64,
                             _MM_HINT_T0);
            }
            __m256 xe[2], xo[2];
            #pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                xe[r] = _mm256_broadcast_ss(xf + r * ldx + kb * 32 + 2 * p);
                xo[r] = _mm256_broadcast_ss(xf + r * ldx + kb * 32 + 2 * p + 1);
            }
            #pragma GCC unroll 8
            for (int g = 0; g < 4; g++) { /* columns 8g .. 8g + 7 */
                const __m256i v = _mm256_loadu_si256(
                    (const __m256i *)(wb + (g >> 1) * 512 + p * 32 + (g & 1) * 16));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
                #pragma GCC unroll 8
                for (int r = 0; r < rows; r++)
                    acc[r][g] = _mm256_fmadd_ps(xo[r], wo, _mm256_fmadd_ps(xe[r], we, acc[r][g]));
            }
        }
    }
    #pragma GCC unroll 8
    for (int g = 0; g < 4; g++) {
        if (8 * g >= cols) continue; /* a constant count keeps the sums in registers */
        const __m256 b = bias ? load8n(bias + 8 * g, cols - 8 * g, 0) : _mm256_setzero_ps();
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
            store8n(y + r * ldy + 8 * g, _mm256_add_ps(acc[r][g], b), cols - 8 * g, 1);
    }
}

AVX2_TARGET static void linear_bf16_panels(void *ctx, int64_t np_begin, int64_t np_end) {
    const linear_bf16_job *j = ctx;
    const int64_t KB = ((j->K + 31) & ~(int64_t)31) / 32;
    const int64_t G = (j->M + 1) / 2; /* groups of two rows */
    for (int64_t np = np_begin; np < np_end; np++) {
        const uint16_t *w = j->wp + np * KB * 1024;
        const char *next = np + 1 < (j->N + 31) / 32 ? (const char *)(w + KB * 1024) : NULL;
        const int64_t n0 = np * 32, cols = j->N - n0 < 32 ? j->N - n0 : 32;
        const float *b = j->bias ? j->bias + n0 : NULL;
        for (int64_t r0 = 0, g = 0; r0 < j->M; r0 += 2, g++) {
            const float *xr = j->xf + r0 * j->ldx;
            uint16_t *yr = j->y + r0 * j->ldy + n0;
            int64_t pl;
            const char *pf = next_panel_share(next, G, g, &pl);
            if (j->M - r0 >= 2) bf16_rows(xr, j->ldx, w, yr, j->ldy, KB, b, cols, pf, pl, 2);
            else bf16_rows(xr, j->ldx, w, yr, j->ldy, KB, b, cols, pf, pl, 1);
        }
    }
}

/* -1: no memory for x's fp32 copy */
AVX2_TARGET int sgl_linear_bf16_avx2(const uint16_t *x, int64_t ldx, const uint16_t *wp,
                                     uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                                     const float *bias) {
    const int64_t Kp = (K + 31) & ~(int64_t)31, NP = (N + 31) / 32;
    float *xf = scratch_f32(M * Kp);
    if (!xf) return -1;
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k < Kp; k += 8)
            _mm256_storeu_ps(xf + r * Kp + k, load8n(x + r * ldx + k, K - k, 1));
    linear_bf16_job job = {xf, wp, y, Kp, ldy, M, N, K, bias};
    sgl_parallel_for(linear_bf16_panels, &job, NP, panel_chunk(NP));
    return 0;
}

/* -- RMSNorm, SiLU x up, rotary ----------------------------------------------------------------
 * The arguments and rounding of kernels_avx512.c's sgl_rmsnorm, sgl_silu_mul and sgl_rotary. */

AVX2_TARGET static void rmsnorm_rows(void *ctx, int64_t t0, int64_t t1) {
    rmsnorm_job *j = ctx;
    const int dtype = j->dtype;
    const int64_t es = dtype ? 2 : 4, H = j->H, heads = j->heads;
    float *h = scratch_f32(H + 8); /* per thread */
    if (!h) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t t = t0; t < t1; t++) {
        const char *xr = (const char *)j->x + ((t / heads) * j->x_stride + (t % heads) * H) * es;
        const char *rr = j->residual ? (const char *)j->residual + t * j->r_stride * es : NULL;
        char *ror = j->res_out ? (char *)j->res_out + t * j->ro_stride * es : NULL;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < H; i += 8) {
            __m256 v = load8n(xr + i * es, H - i, dtype);
            if (rr) {
                v = _mm256_add_ps(v, load8n(rr + i * es, H - i, dtype));
                if (dtype) v = round_bf16(v);
                if (ror) store8n(ror + i * es, v, H - i, dtype);
            }
            _mm256_storeu_ps(h + i, v);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 f = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)H + j->eps));
        char *orow = (char *)j->out + t * j->o_stride * es;
        for (int64_t i = 0; i < H; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(h + i), f);
            if (dtype) v = round_bf16(v);
            const __m256 w = load8n((const char *)j->weight + i * es, H - i, dtype);
            store8n(orow + i * es, _mm256_mul_ps(v, w), H - i, dtype);
        }
    }
}

AVX2_TARGET int sgl_rmsnorm_avx2(const void *x, int64_t x_stride, const void *residual,
                                 int64_t r_stride, void *res_out, int64_t ro_stride,
                                 const void *weight, void *out, int64_t o_stride, int64_t T,
                                 int64_t H, int64_t heads, float eps, int dtype) {
    return run_rmsnorm(rmsnorm_rows, x, x_stride, residual, r_stride, res_out, ro_stride, weight,
                       out, o_stride, T, H, heads, eps, dtype);
}

AVX2_TARGET static void silu_mul_rows(void *ctx, int64_t t0, int64_t t1) {
    const silu_mul_job *j = ctx;
    const int dtype = j->dtype;
    const int64_t es = dtype ? 2 : 4, d = j->d;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t t = t0; t < t1; t++) {
        const char *xr = (const char *)j->x + t * j->x_stride * es;
        char *orow = (char *)j->out + t * j->o_stride * es;
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 g = load8n(xr + i * es, d - i, dtype);
            const __m256 u = load8n(xr + (d + i) * es, d - i, dtype);
            __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            if (dtype) s = round_bf16(s);
            store8n(orow + i * es, _mm256_mul_ps(s, u), d - i, dtype);
        }
    }
}

AVX2_TARGET int sgl_silu_mul_avx2(const void *x, int64_t x_stride, void *out, int64_t o_stride,
                                  int64_t T, int64_t d, int dtype) {
    return run_silu_mul(silu_mul_rows, x, x_stride, out, o_stride, T, d, dtype);
}

static inline float value_at(const char *p, int64_t i, int dtype) {
    if (!dtype) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

AVX2_TARGET static void rotary_rows(void *ctx, int64_t t0, int64_t t1) {
    const rotary_job *j = ctx;
    const int dtype = j->dtype;
    const int64_t es = dtype ? 2 : 4, H = j->H, D = j->D, rot = j->rot, half = rot / 2;
    for (int64_t t = t0; t < t1; t++) {
        const char *c = (const char *)j->cs + (j->pos ? j->pos[t] : t) * j->cs_stride * es;
        const char *sn = c + rot * es;
        for (int64_t h = 0; h < H; h++) {
            const char *xr = (const char *)j->x + (t * j->x_stride + h * D) * es;
            char *orow = (char *)j->out + (t * H + h) * D * es;
            for (int64_t i = 0; i < rot; i += 8) {
                const int64_t n = rot - i < 8 ? rot - i : 8;
                /* rotate_half(x)[i] = x[i + half] for i < half, x[i - half] after */
                __m256 r;
                if (i + n <= half) {
                    r = load8n(xr + (i + half) * es, n, dtype);
                } else if (i >= half) {
                    r = load8n(xr + (i - half) * es, n, dtype);
                } else { /* the vector straddles the halves */
                    float tmp[8] = {0};
                    for (int64_t e = 0; e < n; e++)
                        tmp[e] = value_at(xr, i + e < half ? i + e + half : i + e - half, dtype);
                    r = _mm256_loadu_ps(tmp);
                }
                const __m256 v = load8n(xr + i * es, n, dtype);
                __m256 a = _mm256_mul_ps(v, load8n(c + i * es, n, dtype));
                __m256 b = _mm256_mul_ps(r, load8n(sn + i * es, n, dtype));
                if (dtype) {
                    a = round_bf16(a);
                    b = round_bf16(b);
                }
                store8n(orow + i * es, _mm256_add_ps(a, b), n, dtype);
            }
            if (rot < D) memcpy(orow + rot * es, xr + rot * es, (size_t)((D - rot) * es));
        }
    }
}

AVX2_TARGET int sgl_rotary_avx2(const void *x, int64_t x_stride, const void *cs,
                                int64_t cs_stride, const int64_t *pos, int64_t cs_rows, void *out,
                                int64_t T, int64_t H, int64_t D, int64_t rot, int dtype) {
    return run_rotary(rotary_rows, x, x_stride, cs, cs_stride, pos, cs_rows, out, T, H, D, rot,
                      dtype);
}

/* -- argmax ------------------------------------------------------------------------------------
 * out[b] = the first index of the maximum of row b (a NaN counts as the maximum, as in torch). */

AVX2_TARGET int sgl_argmax_f32_avx2(const float *x, int64_t stride, int64_t B, int64_t V,
                                    int64_t *out) {
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * stride;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int nan = 0;
        int64_t i = 0;
        for (; i + 8 <= V && !nan; i += 8) {
            const __m256 v = _mm256_loadu_ps(r + i);
            nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, v);
        }
        if (nan) { /* the first NaN */
            int64_t k = i - 8;
            while (r[k] == r[k]) k++;
            out[b] = k;
            continue;
        }
        float m = hmax8(mx);
        int64_t best = -1;
        for (; i < V; i++) {
            if (r[i] != r[i]) {
                best = i;
                break;
            }
            if (r[i] > m) m = r[i];
        }
        if (best >= 0) { /* a NaN in the tail; an earlier one was ruled out above */
            out[b] = best;
            continue;
        }
        const __m256 mv = _mm256_set1_ps(m);
        for (i = 0; i + 8 <= V; i += 8) {
            const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), mv, _CMP_EQ_OQ));
            if (eq) {
                best = i + __builtin_ctz((unsigned)eq);
                break;
            }
        }
        if (best < 0)
            for (; i < V; i++)
                if (r[i] == m) {
                    best = i;
                    break;
                }
        out[b] = best < 0 ? 0 : best;
    }
    return 0;
}

/* -- paged decode attention ------------------------------------------------------------------
 * The arguments and the method of kernels_avx512.c's sgl_decode_attention (bf16_dot is ignored):
 * each query row gets this file's extend kernel's arithmetic operation for operation, so that a
 * token's attention does not depend on whether it was decoded or prefilled. Here the lanes hold 8
 * keys (their K rows transposed) for the scores and 8 V columns for the weighted sum; a work item
 * is one sequence and KV head. */

/* cap * tanh(s / cap) as the attention kernels compute it: tanh(y) = 1 - 2 / (e^2y + 1) */
AVX2_TARGET INLINE __m256 softcapped8(__m256 s, float cap) {
    const __m256 e2 = exp8(_mm256_mul_ps(s, _mm256_set1_ps(2.0f / cap)));
    return _mm256_mul_ps(_mm256_set1_ps(cap),
                         _mm256_sub_ps(_mm256_set1_ps(1.0f),
                                       _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e2, _mm256_set1_ps(1.0f)))));
}

/* c[i] lane j = r[j] lane i: an 8 x 8 transpose */
AVX2_TARGET INLINE void transpose8(const __m256 *r, __m256 *c) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + e], 128-bit lane L: element 4L + e of rows 4i .. 4i + 3 */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int e = 0; e < 4; e++) {
        c[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
        c[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
    }
}

/* kt[d][16]: the 16 keys of rows kr transposed, bfloat16 widened */
AVX2_TARGET INLINE void keys_transposed(const char *const *kr, int64_t D, float *kt, const int dtype) {
    const int64_t es = dtype ? 2 : 4;
    for (int half = 0; half < 2; half++)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8], c[8];
            for (int j = 0; j < 8; j++) r[j] = load8(kr[8 * half + j] + d0 * es, dtype);
            transpose8(r, c);
            for (int i = 0; i < 8; i++) _mm256_store_ps(kt + (d0 + i) * 16 + 8 * half, c[i]);
        }
}

/* s[g * DEC_SLD + lane] (16 lanes) = sum over d in order of kt[d][lane] qs[g * D + d], one FMA
   chain per key and head as ext_qk, for gn (<= 4) heads */
AVX2_TARGET INLINE void dec_qk(const float *kt, const float *qs, int64_t D, float *s, const int gn) {
    __m256 acc[4][2];
    #pragma GCC unroll 4
    for (int g = 0; g < gn; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_load_ps(kt + d * 16), k1 = _mm256_load_ps(kt + d * 16 + 8);
        #pragma GCC unroll 4
        for (int g = 0; g < gn; g++) {
            const __m256 qv = _mm256_broadcast_ss(qs + g * D + d);
            acc[g][0] = _mm256_fmadd_ps(k0, qv, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(k1, qv, acc[g][1]);
        }
    }
    #pragma GCC unroll 4
    for (int g = 0; g < gn; g++) {
        _mm256_storeu_ps(s + g * DEC_SLD, acc[g][0]);
        _mm256_storeu_ps(s + g * DEC_SLD + 8, acc[g][1]);
    }
}

/* ext_softmax's step for the G query rows of an item over a block of nk keys whose first
   `masked` (0 or 1) are outside the window: the scores s[g][x] become the exponentials (0 where
   masked, and past nk up to a multiple of 8), the running maxima m[g] and sums l[g] advance, and
   alpha[g] is the factor of the output so far. */
AVX2_TARGET static void dec_softmax(float *s, int64_t G, int64_t nk, int64_t masked, float softcap,
                                    float *m, float *l, float *alpha) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = 0; g < G; g++) {
        float *row = s + g * DEC_SLD;
        const float m_old = m[g];
        float mx = m_old;
        for (int64_t x = 0; x < nk; x += 8) {
            __m256 v = _mm256_loadu_ps(row + x);
            if (softcap > 0) v = softcapped8(v, softcap);
            const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32((int)x));
            const __m256i live = _mm256_andnot_si256(
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)masked), key),
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nk), key)); /* masked <= key < nk */
            v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(live));
            _mm256_storeu_ps(row + x, v);
            const float bm = hmax8(v);
            mx = bm > mx ? bm : mx;
        }
        const float m_safe = mx != -INFINITY ? mx : 0.0f;
        alpha[g] = 0.0f;
        if (m_old != -INFINITY) { /* the lanes' exp, not the C library's */
            float lanes[8];
            _mm256_storeu_ps(lanes, exp8(_mm256_set1_ps(m_old - m_safe)));
            alpha[g] = lanes[0];
        }
        const __m256 mv = _mm256_set1_ps(m_safe);
        for (int64_t x = 0; x < nk; x += 8) {
            const __m256 v = _mm256_loadu_ps(row + x);
            _mm256_storeu_ps(row + x, _mm256_and_ps(_mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ),
                                                    exp8(_mm256_sub_ps(v, mv))));
        }
        m[g] = mx;
    }
    /* the sums key by key, as ext_softmax's lanes add them; 8 rows' chains side by side */
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
   (<= 2) heads and nv (<= 4) vectors of 8 columns, as ext_pv */
AVX2_TARGET INLINE void dec_pv(const float *p, const char *const *vr, int64_t nk, float *o,
                               int64_t Dv, int64_t col, const float *alpha, const int dtype,
                               const int gn, const int nv) {
    const int64_t es = dtype ? 2 : 4;
    __m256 acc[2][4];
    #pragma GCC unroll 2
    for (int g = 0; g < gn; g++)
        #pragma GCC unroll 4
        for (int i = 0; i < nv; i++)
            acc[g][i] = _mm256_mul_ps(_mm256_load_ps(o + g * Dv + col + 8 * i), _mm256_set1_ps(alpha[g]));
    for (int64_t x = 0; x < nk; x++) {
        __m256 vv[4];
        #pragma GCC unroll 4
        for (int i = 0; i < nv; i++) vv[i] = load8(vr[x] + (col + 8 * i) * es, dtype);
        #pragma GCC unroll 2
        for (int g = 0; g < gn; g++) {
            const __m256 w = _mm256_broadcast_ss(p + g * DEC_SLD + x);
            #pragma GCC unroll 4
            for (int i = 0; i < nv; i++) acc[g][i] = _mm256_fmadd_ps(vv[i], w, acc[g][i]);
        }
    }
    #pragma GCC unroll 2
    for (int g = 0; g < gn; g++)
        #pragma GCC unroll 4
        for (int i = 0; i < nv; i++) _mm256_store_ps(o + g * Dv + col + 8 * i, acc[g][i]);
}

/* Sequence b against KV head hk (dtype constant in each copy). */
AVX2_TARGET INLINE void decode_item(const attention_job *j, int64_t b, int64_t hk,
                                    const dec_buffers *w, const int dtype) {
    const int64_t G = j->Hq / j->Hk, D = j->D, Dv = j->Dv, es = dtype ? 2 : 4;
    int64_t n;
    const int64_t start = decode_window_start(j, b, &n);
    n += start; /* keys start .. n - 1 */
    const int64_t *slots = j->table + j->rows[b] * j->table_stride;
    const char *qb = (const char *)j->q + (b * j->q_stride_t + hk * G * j->q_stride_h) * es;
    for (int64_t g = 0; g < G; g++) {
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(w->qs + g * D + d, _mm256_mul_ps(load8(qb + (g * j->q_stride_h + d) * es, dtype),
                                                             _mm256_set1_ps(j->scale)));
        w->m[g] = -INFINITY;
        w->l[g] = 0.0f;
    }
    memset(w->o, 0, (size_t)(G * Dv) * sizeof(float));
    const char *kr[EXT_KB], *vr[EXT_KB];
    for (int64_t k0 = start & ~(int64_t)1, k1; k0 < n; k0 = k1) { /* the extend kernel's blocks */
        const int64_t nk = dec_block(j, slots, hk, k0, n, kr, vr, &k1);
        dec_ahead_advance(j, w->ahead, nk * (D + Dv) * es);
        for (int64_t x0 = 0; x0 < nk; x0 += 16) {
            const char *rows[16]; /* a short last group repeats its first key */
            for (int i = 0; i < 16; i++) rows[i] = kr[x0 + i < nk ? x0 + i : x0];
            keys_transposed(rows, D, w->kt, dtype);
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                float *s = w->s + g0 * DEC_SLD + x0;
                const float *qs = w->qs + g0 * D;
                switch (G - g0 < 4 ? G - g0 : 4) {
                case 4: dec_qk(w->kt, qs, D, s, 4); break;
                case 3: dec_qk(w->kt, qs, D, s, 3); break;
                case 2: dec_qk(w->kt, qs, D, s, 2); break;
                default: dec_qk(w->kt, qs, D, s, 1);
                }
            }
        }
        dec_softmax(w->s, G, nk, k0 < start ? start - k0 : 0, j->softcap, w->m, w->l, w->alpha);
        for (int64_t col = 0; col < Dv; col += 32) {
            const int64_t nv = Dv - col >= 32 ? 4 : (Dv - col) / 8;
            for (int64_t g0 = 0; g0 < G; g0 += 2) {
                const float *p = w->s + g0 * DEC_SLD, *alpha = w->alpha + g0;
                float *o = w->o + g0 * Dv;
#define DEC_PV(GN, NV) dec_pv(p, vr, nk, o, Dv, col, alpha, dtype, GN, NV)
                const int two = G - g0 >= 2;
                switch (nv) { /* constant counts keep the sums in registers */
                case 4: if (two) DEC_PV(2, 4); else DEC_PV(1, 4); break;
                case 3: if (two) DEC_PV(2, 3); else DEC_PV(1, 3); break;
                case 2: if (two) DEC_PV(2, 2); else DEC_PV(1, 2); break;
                default: if (two) DEC_PV(2, 1); else DEC_PV(1, 1);
                }
#undef DEC_PV
            }
        }
    }
    char *ob = (char *)j->out + (b * j->out_stride_t + hk * G * Dv) * es;
    for (int64_t g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps(w->l[g] > 0 ? 1.0f / w->l[g] : 0.0f);
        for (int64_t c = 0; c < Dv; c += 8)
            store8(ob + (g * Dv + c) * es, _mm256_mul_ps(_mm256_load_ps(w->o + g * Dv + c), inv), dtype);
    }
}

/* Items [i0, i1) of a decode attention batch: item i is sequence i / Hk, KV head i % Hk. */
AVX2_TARGET static void decode_attention_items(void *ctx, int64_t i0, int64_t i1) {
    attention_job *j = ctx;
    dec_buffers w; /* per thread */
    if (dec_buffers_get(j, 16, &w)) {
        atomic_store(&j->failed, 1);
        return;
    }
    dec_ahead ahead = {i0, 0, i1};
    w.ahead = &ahead;
    dec_ahead_advance(j, &ahead, DEC_AHEAD_BYTES);
    for (int64_t i = i0; i < i1; i++) {
        if (j->dtype) decode_item(j, i / j->Hk, i % j->Hk, &w, 1);
        else decode_item(j, i / j->Hk, i % j->Hk, &w, 0);
    }
}

AVX2_TARGET int sgl_decode_attention_avx2(
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

/* -- paged extend (prefill) attention ---------------------------------------------------------
 * The arguments and method of kernels_avx512.c's sgl_extend_attention: a work item is a tile of
 * query tokens of one sequence times one KV head, up to 64 query rows that lie in the lanes
 * (queries transposed, qt [D][64]; scores st [key][64]; output ot [Dv][64]), walking the keys in
 * blocks of 64 with an online softmax. Here a row vector is 8 rows, and the score and output
 * steps take up to 4 of them at a time against 2 keys or 2 output columns (8 sums, 4 row vectors
 * and one broadcast: 13 registers). */

/* st[x][8 (b0 + b) ..] = sum_d k_x[d] qt[d][8 (b0 + b) ..] for keys x < nx (<= 2), b < nb (<= 4) */
AVX2_TARGET INLINE void ext_qk(const float *const *k, int64_t D, const float *qt, float *st,
                               int b0, const int nx, const int nb) {
    __m256 acc[2][4];
    #pragma GCC unroll 8
    for (int x = 0; x < nx; x++)
        #pragma GCC unroll 8
        for (int b = 0; b < nb; b++) acc[x][b] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 qv[4];
        #pragma GCC unroll 8
        for (int b = 0; b < nb; b++) qv[b] = _mm256_load_ps(qt + d * EXT_ROWS + 8 * (b0 + b));
        #pragma GCC unroll 8
        for (int x = 0; x < nx; x++) {
            const __m256 kv = _mm256_broadcast_ss(k[x] + d);
            #pragma GCC unroll 8
            for (int b = 0; b < nb; b++) acc[x][b] = _mm256_fmadd_ps(kv, qv[b], acc[x][b]);
        }
    }
    #pragma GCC unroll 8
    for (int x = 0; x < nx; x++)
        #pragma GCC unroll 8
        for (int b = 0; b < nb; b++) _mm256_store_ps(st + x * EXT_ROWS + 8 * (b0 + b), acc[x][b]);
}

/* ot[c0 + c][8 (b0 + b) ..] += sum_x v_x[c0 + c] pt[x][8 (b0 + b) ..] for c < nc (<= 2) */
AVX2_TARGET INLINE void ext_pv(const float *const *v, int64_t nk, const float *pt, float *ot,
                               int64_t c0, int b0, const int nc, const int nb) {
    __m256 acc[2][4];
    #pragma GCC unroll 8
    for (int c = 0; c < nc; c++)
        #pragma GCC unroll 8
        for (int b = 0; b < nb; b++)
            acc[c][b] = _mm256_load_ps(ot + (c0 + c) * EXT_ROWS + 8 * (b0 + b));
    for (int64_t x = 0; x < nk; x++) {
        __m256 pv[4];
        #pragma GCC unroll 8
        for (int b = 0; b < nb; b++) pv[b] = _mm256_load_ps(pt + x * EXT_ROWS + 8 * (b0 + b));
        #pragma GCC unroll 8
        for (int c = 0; c < nc; c++) {
            const __m256 vv = _mm256_broadcast_ss(v[x] + c0 + c);
            #pragma GCC unroll 8
            for (int b = 0; b < nb; b++) acc[c][b] = _mm256_fmadd_ps(vv, pv[b], acc[c][b]);
        }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < nc; c++)
        #pragma GCC unroll 8
        for (int b = 0; b < nb; b++)
            _mm256_store_ps(ot + (c0 + c) * EXT_ROWS + 8 * (b0 + b), acc[c][b]);
}

#define EXT_NB_SWITCH(CALL, NB)                                                                 \
    switch (NB) {                                                                               \
    case 4: CALL(4); break;                                                                     \
    case 3: CALL(3); break;                                                                     \
    case 2: CALL(2); break;                                                                     \
    default: CALL(1);                                                                           \
    }

/* the online-softmax step of one row vector (8 rows) over keys k0 .. k0 + nk of a block */
AVX2_TARGET INLINE void ext_softmax(const extend_job *j, float *st, float *ot, float *mrow,
                                    float *lrow, const int32_t *pos, const int32_t *tbits,
                                    int64_t prefix, int64_t k0, int64_t nk, int rb) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i p = _mm256_loadu_si256((const __m256i *)(pos + 8 * rb));
    const __m256i lo = j->window > 0 ? _mm256_sub_epi32(p, _mm256_set1_epi32((int)j->window - 1))
                                     : _mm256_setzero_si256();
    __m256 mx = _mm256_load_ps(mrow + 8 * rb);
    const __m256 m_old = mx;
    const __m256i seen = tbits ? _mm256_loadu_si256((const __m256i *)(tbits + 8 * rb))
                               : _mm256_setzero_si256();
    int any = 0;
    for (int64_t x = 0; x < nk; x++) {
        const __m256i key = _mm256_set1_epi32((int)(k0 + x));
        /* lo <= key <= p */
        __m256 ok = _mm256_castsi256_ps(_mm256_andnot_si256(
            _mm256_or_si256(_mm256_cmpgt_epi32(key, p), _mm256_cmpgt_epi32(lo, key)),
            _mm256_set1_epi32(-1)));
        const int64_t jn = k0 + x - prefix; /* the key's index among the new tokens */
        if (tbits && jn >= 0 && jn < 32) { /* a tree: only the rows whose bit jn is set */
            const __m256i unseen = _mm256_cmpeq_epi32(
                _mm256_and_si256(seen, _mm256_set1_epi32((int)(1u << jn))), _mm256_setzero_si256());
            ok = _mm256_andnot_ps(_mm256_castsi256_ps(unseen), ok);
        }
        __m256 s = _mm256_load_ps(st + x * EXT_ROWS + 8 * rb);
        if (j->softcap > 0) s = softcapped8(s, j->softcap);
        s = _mm256_blendv_ps(ninf, s, ok);
        _mm256_store_ps(st + x * EXT_ROWS + 8 * rb, s);
        mx = _mm256_max_ps(mx, s);
        any |= _mm256_movemask_ps(ok);
    }
    if (!any) { /* no row of these 8 sees a key of this block */
        for (int64_t x = 0; x < nk; x++) _mm256_store_ps(st + x * EXT_ROWS + 8 * rb, _mm256_setzero_ps());
        return;
    }
    const __m256 m_safe = _mm256_and_ps(_mm256_cmp_ps(mx, ninf, _CMP_NEQ_OQ), mx); /* -inf: 0 */
    const __m256 alpha = _mm256_and_ps(_mm256_cmp_ps(m_old, ninf, _CMP_NEQ_OQ),
                                       exp8(_mm256_sub_ps(m_old, m_safe)));
    __m256 sum = _mm256_mul_ps(_mm256_load_ps(lrow + 8 * rb), alpha);
    for (int64_t x = 0; x < nk; x++) {
        const __m256 s = _mm256_load_ps(st + x * EXT_ROWS + 8 * rb);
        const __m256 e = _mm256_and_ps(_mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ),
                                       exp8(_mm256_sub_ps(s, m_safe)));
        _mm256_store_ps(st + x * EXT_ROWS + 8 * rb, e);
        sum = _mm256_add_ps(sum, e);
    }
    _mm256_store_ps(lrow + 8 * rb, sum);
    _mm256_store_ps(mrow + 8 * rb, mx);
    for (int64_t c = 0; c < j->Dv; c++)
        _mm256_store_ps(ot + c * EXT_ROWS + 8 * rb,
                        _mm256_mul_ps(_mm256_load_ps(ot + c * EXT_ROWS + 8 * rb), alpha));
}

AVX2_TARGET static void extend_attention_items(void *ctx, int64_t i0, int64_t i1) {
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
    for (int64_t item = i0; item < i1; item++) {
        const extend_item it = extend_locate(j, item);
        const int64_t hk = it.hk, rows = it.rows, p_last = it.p_last, *slots = it.slots;
        const int64_t prefix = j->prefix_lens[it.b];
        const int nbv = (int)((rows + 7) / 8);
        extend_item_reset(j, &it, &buf);
        extend_load_queries(j, &it, qt);
        for (int64_t k0 = it.k_begin & ~(int64_t)1, k1; k0 <= p_last; k0 = k1) {
            k1 = (k0 / EXT_KB + 1) * EXT_KB < p_last + 1 ? (k0 / EXT_KB + 1) * EXT_KB : p_last + 1;
            const int64_t nk = k1 - k0; /* blocks end at multiples of EXT_KB (see extend_locate) */
            for (int64_t x = 0; x < nk; x++) {
                const char *kr = j->kp + slots[k0 + x] * j->k_row + hk * D * es;
                const char *vr = j->vp + slots[k0 + x] * j->v_row + hk * Dv * es;
                if (j->dtype) { /* widen the block once; float32 is read in place */
                    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kf + x * D + d, load8(kr + d * es, 1));
                    for (int64_t d = 0; d < Dv; d += 8) _mm256_storeu_ps(vf + x * Dv + d, load8(vr + d * es, 1));
                    kx[x] = kf + x * D;
                    vx[x] = vf + x * Dv;
                } else {
                    kx[x] = (const float *)kr;
                    vx[x] = (const float *)vr;
                }
            }
            for (int b0 = 0; b0 < nbv; b0 += 4) {
                const int nb = nbv - b0 < 4 ? nbv - b0 : 4;
                for (int64_t x = 0; x < nk; x += 2) {
#define EXT_QK(NB)                                                                              \
    if (nk - x >= 2) ext_qk(kx + x, D, qt, st + x * EXT_ROWS, b0, 2, NB);                       \
    else ext_qk(kx + x, D, qt, st + x * EXT_ROWS, b0, 1, NB)
                    EXT_NB_SWITCH(EXT_QK, nb)
#undef EXT_QK
                }
            }
            for (int rb = 0; rb < nbv; rb++)
                ext_softmax(j, st, ot, mrow, lrow, pos, tbits, prefix, k0, nk, rb);
            for (int b0 = 0; b0 < nbv; b0 += 4) {
                const int nb = nbv - b0 < 4 ? nbv - b0 : 4;
                for (int64_t c = 0; c < Dv; c += 2) { /* Dv is even (a multiple of 16) */
#define EXT_PV(NB) ext_pv(vx, nk, st, ot, c, b0, 2, NB)
                    EXT_NB_SWITCH(EXT_PV, nb)
#undef EXT_PV
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const float inv = lrow[r] > 0 ? 1.0f / lrow[r] : 0.0f;
            char *dst = extend_out_row(j, &it, r);
            float tmp[8];
            for (int64_t c = 0; c < Dv; c += 8) {
                for (int e = 0; e < 8; e++) tmp[e] = ot[(c + e) * EXT_ROWS + r];
                store8(dst + c * es, _mm256_mul_ps(_mm256_loadu_ps(tmp), _mm256_set1_ps(inv)),
                       j->dtype);
            }
        }
    }
}

#undef EXT_NB_SWITCH

AVX2_TARGET int sgl_extend_attention_avx2(
    const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int64_t *table,
    int64_t table_stride, const int64_t *rows, const int64_t *q_starts, const int64_t *prefix_lens,
    const int64_t *extend_lens, int64_t B, void *out, int64_t out_stride, int64_t Hq, int64_t Hk,
    int64_t D, int64_t Dv, float scale, float softcap, int64_t window, int dtype, int bf16_dot,
    const int32_t *tree_bits) {
    (void)bf16_dot; /* no vdpbf16ps at this level */
    return run_extend_attention(extend_attention_items, q, q_stride, k_pool, v_pool, table,
                                table_stride, rows, q_starts, prefix_lens, extend_lens, B, out,
                                out_stride, Hq, Hk, D, Dv, scale, softcap, window, dtype, 0,
                                tree_bits);
}

#endif
