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
 * The arguments of kernels_avx512.c's sgl_decode_attention (bf16_dot is ignored). Per sequence:
 * q scaled to fp32 once, the scores of 8 tokens at a time for each query head (8 dot products
 * summed across in one transpose), a softmax per head, then the weighted sum of V for two query
 * heads of a KV head at a time over up to 32 columns (8 sums, 4 V vectors in registers), in
 * passes of PV_TOKENS tokens whose fp32 partial sums wait in per-thread scratch. The sequences
 * are shared out over the pool's threads. */

/* The K and V rows of tokens [t0, t1) (t1 clipped to n) into L2. The QK pass fetches
   KV_PREFETCH_AHEAD tokens ahead, a few tokens per query head rather than a burst per block. */
AVX2_TARGET INLINE void prefetch_kv(const char *kp, int64_t k_row, const char *vp, int64_t v_row,
                                    const int64_t *slots, int64_t t0, int64_t t1, int64_t n) {
    for (int64_t t = t0; t < t1 && t < n; t++) {
        prefetch_l2(kp + slots[t] * k_row, k_row);
        prefetch_l2(vp + slots[t] * v_row, v_row);
    }
}

/* scores[h * ld + t] for t < n: q_h . k[slots[t]] (q already scaled, fp32 [Hq][D]) */
AVX2_TARGET INLINE void decode_qk(const float *qs, const char *kp, int64_t k_row, const char *vp,
                                  int64_t v_row, const int64_t *slots, int64_t n, float *scores,
                                  int64_t ld, int64_t Hq, int64_t G, int64_t D, const int dtype) {
    const int64_t es = dtype ? 2 : 4;
    prefetch_kv(kp, k_row, vp, v_row, slots, 0, KV_PREFETCH_AHEAD, n);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int64_t cnt = n - t0 < 8 ? n - t0 : 8;
        const char *rows[8];
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) rows[j] = kp + slots[t0 + (j < cnt ? j : 0)] * k_row;
        for (int64_t h = 0; h < Hq; h++) {
            const int64_t ahead = t0 + KV_PREFETCH_AHEAD; /* this head's share of 8 tokens */
            prefetch_kv(kp, k_row, vp, v_row, slots, ahead + h * 8 / Hq, ahead + (h + 1) * 8 / Hq, n);
            const float *qh = qs + h * D;
            const int64_t off = (h / G) * D * es;
            /* the 8 rows' sums side by side (8 independent chains), each in the order d = 0, 8,
               ...; a short last block repeats its first row */
            __m256 acc[8];
            const __m256 q0 = _mm256_loadu_ps(qh);
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[j] = _mm256_mul_ps(q0, load8(rows[j] + off, dtype));
            for (int64_t d = 8; d < D; d += 8) {
                const __m256 qd = _mm256_loadu_ps(qh + d);
                #pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(qd, load8(rows[j] + off + d * es, dtype), acc[j]);
            }
            store8n(scores + h * ld + t0, sum8x8(acc), cnt, 0);
        }
    }
}

/* The sums over tokens t < n of p_h[t] v[slots[t]] for columns [off, off + 8 nv) of gn (<= 2)
   query heads, continued from sums[g * Dv ..] (fp32) unless `first`; kept there again, or, when
   `out` is given, divided by the softmax sums inv_sum[g] and stored to out[g * out_head ..] */
AVX2_TARGET INLINE void decode_pv(const float *p, int64_t ld, int64_t n, const char *vp,
                                  int64_t v_row, int64_t off, const int64_t *slots, float *sums,
                                  int64_t Dv, int first, char *out, int64_t out_head,
                                  const float *inv_sum, const int dtype, const int gn,
                                  const int nv) {
    const int64_t es = dtype ? 2 : 4;
    __m256 acc[2][4];
    #pragma GCC unroll 8
    for (int g = 0; g < gn; g++)
        #pragma GCC unroll 8
        for (int i = 0; i < nv; i++)
            acc[g][i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + g * Dv + i * 8);
    int64_t t = 0;
    if (gn == 1) { /* one head: the odd tokens in a second set of sums, so that 2 nv chains run */
        __m256 odd[4];
        #pragma GCC unroll 8
        for (int i = 0; i < nv; i++) odd[i] = _mm256_setzero_ps();
        for (; t + 1 < n; t += 2) {
            const char *v0 = vp + slots[t] * v_row + off, *v1 = vp + slots[t + 1] * v_row + off;
            const __m256 w0 = _mm256_broadcast_ss(p + t), w1 = _mm256_broadcast_ss(p + t + 1);
            #pragma GCC unroll 8
            for (int i = 0; i < nv; i++) {
                acc[0][i] = _mm256_fmadd_ps(w0, load8(v0 + i * 8 * es, dtype), acc[0][i]);
                odd[i] = _mm256_fmadd_ps(w1, load8(v1 + i * 8 * es, dtype), odd[i]);
            }
        }
        #pragma GCC unroll 8
        for (int i = 0; i < nv; i++) acc[0][i] = _mm256_add_ps(acc[0][i], odd[i]);
    }
    for (; t < n; t++) {
        const char *vr = vp + slots[t] * v_row + off;
        __m256 vv[4];
        #pragma GCC unroll 8
        for (int i = 0; i < nv; i++) vv[i] = load8(vr + i * 8 * es, dtype);
        #pragma GCC unroll 8
        for (int g = 0; g < gn; g++) {
            const __m256 w = _mm256_broadcast_ss(p + g * ld + t);
            #pragma GCC unroll 8
            for (int i = 0; i < nv; i++) acc[g][i] = _mm256_fmadd_ps(w, vv[i], acc[g][i]);
        }
    }
    #pragma GCC unroll 8
    for (int g = 0; g < gn; g++) {
        const __m256 f = _mm256_set1_ps(out ? inv_sum[g] : 1.0f);
        #pragma GCC unroll 8
        for (int i = 0; i < nv; i++) {
            if (out) store8(out + (g * out_head + i * 8) * es, _mm256_mul_ps(acc[g][i], f), dtype);
            else _mm256_storeu_ps(sums + g * Dv + i * 8, acc[g][i]);
        }
    }
}

/* Tokens per pass of the weighted sum of V: the passes over one KV head's columns and query
   heads read this many rows again from L1 (PV_TOKENS * Dv * 4 bytes), not from memory */
#define PV_TOKENS 64

#define DECODE_PV(GN, NV)                                                                      \
    decode_pv(scores + h * ld + t0, ld, nt, j->vp, j->v_row, (hk * Dv + col) * es, slots + t0, \
              sums + h * Dv + col, Dv, t0 == 0, last ? ob + (h * Dv + col) * es : NULL, Dv,     \
              inv_sum + h, dtype, GN, NV)

AVX2_TARGET INLINE void decode_seq(attention_job *j, int64_t b, float *qs, float *sums,
                                   float *scores, const int dtype) {
    const int64_t Hq = j->Hq, Hk = j->Hk, G = Hq / Hk, D = j->D, Dv = j->Dv, es = dtype ? 2 : 4;
    int64_t n;
    const int64_t start = decode_window_start(j, b, &n);
    const int64_t *slots = j->table + j->rows[b] * j->table_stride + start;
    const int64_t ld = (n + 7) & ~(int64_t)7;
    float inv_sum[MAX_HEADS];
    const char *qb = (const char *)j->q + b * j->q_stride_t * es;
    char *ob = (char *)j->out + b * j->out_stride_t * es;
    const __m256 sv = _mm256_set1_ps(j->scale);
    for (int64_t h = 0; h < Hq; h++)
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(qs + h * D + d,
                             _mm256_mul_ps(load8(qb + (h * j->q_stride_h + d) * es, dtype), sv));
    decode_qk(qs, j->kp, j->k_row, j->vp, j->v_row, slots, n, scores, ld, Hq, G, D, dtype);
    for (int64_t h = 0; h < Hq; h++) { /* softmax; the padding past n is -inf, so e = 0 there */
        float *s = scores + h * ld;
        if (j->softcap > 0)
            for (int64_t t = 0; t < n; t++) s[t] = j->softcap * tanhf(s[t] / j->softcap);
        for (int64_t t = n; t < ld; t++) s[t] = -INFINITY;
        __m256 mx = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < ld; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
        const __m256 mv = _mm256_set1_ps(hmax8(mx));
        for (int64_t t = 0; t < ld; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
            _mm256_storeu_ps(s + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        inv_sum[h] = 1.0f / hsum8(sum);
    }
    for (int64_t hk = 0; hk < Hk; hk++)
        for (int64_t t0 = 0; t0 < n; t0 += PV_TOKENS) {
            const int64_t nt = n - t0 < PV_TOKENS ? n - t0 : PV_TOKENS;
            const int last = t0 + nt == n;
            for (int64_t t = t0 + nt; t < t0 + 2 * PV_TOKENS && t < n; t++) /* the next pass's */
                for (int64_t o = 0; o < Dv * es; o += 64)
                    _mm_prefetch(j->vp + slots[t] * j->v_row + hk * Dv * es + o, _MM_HINT_T0);
            for (int64_t col = 0; col < Dv; col += 32) {
                const int64_t nv = Dv - col >= 32 ? 4 : (Dv - col) / 8;
                for (int64_t g0 = 0; g0 < G; g0 += 2) {
                    const int64_t h = hk * G + g0;
                    const int two = G - g0 >= 2;
                    switch (nv) { /* constant counts keep the sums in registers */
                    case 4: if (two) DECODE_PV(2, 4); else DECODE_PV(1, 4); break;
                    case 3: if (two) DECODE_PV(2, 3); else DECODE_PV(1, 3); break;
                    case 2: if (two) DECODE_PV(2, 2); else DECODE_PV(1, 2); break;
                    default: if (two) DECODE_PV(2, 1); else DECODE_PV(1, 1);
                    }
                }
            }
        }
}

#undef DECODE_PV

AVX2_TARGET static void decode_attention_range(void *ctx, int64_t b0, int64_t b1) {
    attention_job *j = ctx;
    /* per thread: q scaled [Hq][D], V sums [Hq][Dv], scores [Hq][max_len rounded up to 8] */
    float *qs = scratch_f32(j->Hq * (j->D + j->Dv) + j->Hq * (j->max_len + 8));
    if (!qs) {
        atomic_store(&j->failed, 1);
        return;
    }
    float *sums = qs + j->Hq * j->D, *scores = sums + j->Hq * j->Dv;
    for (int64_t b = b0; b < b1; b++) {
        if (j->dtype) decode_seq(j, b, qs, sums, scores, 1); /* constant dtypes: no branch per load */
        else decode_seq(j, b, qs, sums, scores, 0);
    }
}

AVX2_TARGET int sgl_decode_attention_avx2(
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_new, int64_t k_new_stride,
    const void *v_new, int64_t v_new_stride, void *k_pool, void *v_pool, const int64_t *table,
    int64_t table_stride, const int64_t *rows, const int64_t *lens, const int64_t *loc, void *out,
    int64_t out_stride_t, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, float scale,
    float softcap, int64_t window, int dtype, int bf16_dot) {
    return run_decode_attention(decode_attention_range, q, q_stride_t, q_stride_h, k_new,
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
        if (j->softcap > 0) { /* cap * tanh(s / cap), tanh(y) = 1 - 2 / (e^2y + 1) */
            const __m256 e2 = exp8(_mm256_mul_ps(s, _mm256_set1_ps(2.0f / j->softcap)));
            s = _mm256_mul_ps(_mm256_set1_ps(j->softcap),
                              _mm256_sub_ps(_mm256_set1_ps(1.0f),
                                            _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                          _mm256_add_ps(e2, _mm256_set1_ps(1.0f)))));
        }
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
        for (int64_t k0 = it.k_begin; k0 <= p_last; k0 += EXT_KB) {
            const int64_t nk = p_last + 1 - k0 < EXT_KB ? p_last + 1 - k0 : EXT_KB;
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
