/* The AMX, AVX512-BF16 and AVX-512 instructions in software, so that kernels_avx512.c can be
 * compiled a second time (kernels_avx512_emulated.c) and run on a CPU with AVX2 only: the tests
 * then check the logic of every level on every x86-64 machine, not only on one that has it.
 * Correct, not fast: the emulated kernels run several times slower than the AVX2 ones.
 *
 * The AVX-512 intrinsics come from SIMDe (SIMD Everywhere, Debian's libsimde-dev), whose
 * aliases give each `_mm512_*` name its portable implementation; the few this SIMDe release
 * lacks are written below, one lane at a time, from Intel's descriptions. The AMX tile
 * instructions are emulated here too: eight tiles per thread, configured by _tile_loadconfig,
 * with TDPBF16PS's order of products (the even element of each pair first), as in Intel's
 * pseudo-code. As on the hardware, bfloat16 conversions treat denormal inputs as zero.
 *
 * Included only by kernels_avx512_emulated.c, and only where SIMDe's headers are found. */
#ifndef SGL_ISA_EMULATION_H
#define SGL_ISA_EMULATION_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* the exported kernels of kernels_avx512.c get their own names in this copy */
#define sgl_linear_bf16_amx sgl_linear_bf16_amx_emulated
#define sgl_linear_bf16_avx512 sgl_linear_bf16_avx512_emulated
#define sgl_linear_f32 sgl_linear_f32_emulated
#define sgl_rmsnorm sgl_rmsnorm_emulated
#define sgl_silu_mul sgl_silu_mul_emulated
#define sgl_rotary sgl_rotary_emulated
#define sgl_argmax_f32 sgl_argmax_f32_emulated
#define sgl_decode_attention sgl_decode_attention_emulated
#define sgl_extend_attention sgl_extend_attention_emulated
#define sgl_linear_quant_avx512 sgl_linear_quant_avx512_emulated
#define sgl_linear_w8a8_avx512 sgl_linear_w8a8_avx512_emulated
#define sgl_bf16_panel_avx512 sgl_bf16_panel_avx512_emulated
#define sgl_avx512_kernels_native sgl_avx512_kernels_emulated

/* -- AVX-512 intrinsics this SIMDe release does not have ------------------------------------ */

static inline float emu_f32_of_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* VCVTNEPS2BF16: round to nearest even; NaN stays a quiet NaN; denormals become zero */
static inline uint16_t emu_bf16_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline simde__m256i emu_mm512_cvtneps_pbh(simde__m512 v) {
    simde__m512_private a = simde__m512_to_private(v);
    simde__m256i_private r;
    for (int i = 0; i < 16; i++) r.u16[i] = emu_bf16_of_f32(a.f32[i]);
    return simde__m256i_from_private(r);
}

static inline simde__m512 emu_mm512_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    simde__m512_private r;
    const float *f = (const float *)p;
    for (int i = 0; i < 16; i++) r.f32[i] = (k >> i) & 1 ? f[i] : 0.0f;
    return simde__m512_from_private(r);
}

static inline void emu_mm512_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 v) {
    simde__m512_private a = simde__m512_to_private(v);
    float *f = (float *)p;
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) f[i] = a.f32[i];
}

static inline simde__m256i emu_mm256_maskz_loadu_epi16(simde__mmask16 k, const void *p) {
    simde__m256i_private r;
    const uint16_t *h = (const uint16_t *)p;
    for (int i = 0; i < 16; i++) r.u16[i] = (k >> i) & 1 ? h[i] : 0;
    return simde__m256i_from_private(r);
}

static inline void emu_mm256_mask_storeu_epi16(void *p, simde__mmask16 k, simde__m256i v) {
    simde__m256i_private a = simde__m256i_to_private(v);
    uint16_t *h = (uint16_t *)p;
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) h[i] = a.u16[i];
}

/* 16 int32 lanes truncated to 16 int16 */
static inline simde__m256i emu_mm512_cvtepi32_epi16(simde__m512i v) {
    simde__m512i_private a = simde__m512i_to_private(v);
    simde__m256i_private r;
    for (int i = 0; i < 16; i++) r.u16[i] = (uint16_t)a.u32[i];
    return simde__m256i_from_private(r);
}

/* VCVTNE2PS2BF16: words 0-15 from b, 16-31 from a, each rounded as VCVTNEPS2BF16 */
static inline simde__m512i emu_mm512_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    simde__m512_private pa = simde__m512_to_private(a), pb = simde__m512_to_private(b);
    simde__m512i_private r;
    for (int i = 0; i < 16; i++) {
        r.u16[i] = emu_bf16_of_f32(pb.f32[i]);
        r.u16[16 + i] = emu_bf16_of_f32(pa.f32[i]);
    }
    return simde__m512i_from_private(r);
}

/* VPSRAD with an immediate: each int32 lane shifted right arithmetically (sign bits in) */
static inline simde__m512i emu_mm512_srai_epi32(simde__m512i v, unsigned int n) {
    simde__m512i_private a = simde__m512i_to_private(v), r;
    for (int i = 0; i < 16; i++) r.i32[i] = n > 31 ? (a.i32[i] < 0 ? -1 : 0) : a.i32[i] >> n;
    return simde__m512i_from_private(r);
}

/* 16 uint16 lanes zero-extended to int32 */
static inline simde__m512i emu_mm512_cvtepu16_epi32(simde__m256i v) {
    simde__m256i_private a = simde__m256i_to_private(v);
    simde__m512i_private r;
    for (int i = 0; i < 16; i++) r.u32[i] = a.u16[i];
    return simde__m512i_from_private(r);
}

/* VPCMPD's predicates: 0 eq, 1 lt, 2 le, 3 false, 4 ne, 5 not lt, 6 not le, 7 true */
static inline simde__mmask16 emu_mm512_cmp_epi32_mask(simde__m512i x, simde__m512i y, int pred) {
    simde__m512i_private a = simde__m512i_to_private(x), b = simde__m512i_to_private(y);
    simde__mmask16 m = 0;
    for (int i = 0; i < 16; i++) {
        const int32_t p = a.i32[i], q = b.i32[i];
        const int bit = pred == 0 ? p == q : pred == 1 ? p < q : pred == 2 ? p <= q
                      : pred == 3 ? 0 : pred == 4 ? p != q : pred == 5 ? p >= q
                      : pred == 6 ? p > q : 1;
        m |= (simde__mmask16)(bit << i);
    }
    return m;
}

/* 16 uint8 / int8 lanes widened to int32 */
static inline simde__m512i emu_mm512_cvtepu8_epi32(simde__m128i v) {
    simde__m128i_private a = simde__m128i_to_private(v);
    simde__m512i_private r;
    for (int i = 0; i < 16; i++) r.i32[i] = a.u8[i];
    return simde__m512i_from_private(r);
}

static inline simde__m512i emu_mm512_cvtepi8_epi32(simde__m128i v) {
    simde__m128i_private a = simde__m128i_to_private(v);
    simde__m512i_private r;
    for (int i = 0; i < 16; i++) r.i32[i] = a.i8[i];
    return simde__m512i_from_private(r);
}

static inline simde__m512 emu_mm512_cvtepi32_ps(simde__m512i v) {
    simde__m512i_private a = simde__m512i_to_private(v);
    simde__m512_private r;
    for (int i = 0; i < 16; i++) r.f32[i] = (float)a.i32[i];
    return simde__m512_from_private(r);
}

/* the reductions pair lanes as gcc's headers do: halves, then quarters, ... */
static inline float emu_mm512_reduce_add_ps(simde__m512 v) {
    simde__m512_private a = simde__m512_to_private(v);
    float t[16];
    memcpy(t, &a, sizeof t);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
    return t[0];
}

/* VSCALEFPS: a * 2^floor(b) rounded once (SIMDe multiplies by exp2(floor(b)), which is
   already infinite at b = 128, where a < 1 would still give a finite product) */
static inline simde__m512 emu_mm512_scalef_ps(simde__m512 a, simde__m512 b) {
    simde__m512_private x = simde__m512_to_private(a), y = simde__m512_to_private(b), r;
    for (int i = 0; i < 16; i++) {
        const float n = y.f32[i];
        if (n != n || x.f32[i] != x.f32[i]) {
            r.f32[i] = x.f32[i] + n;
        } else {
            const float e = floorf(n < -400.0f ? -400.0f : n > 400.0f ? 400.0f : n);
            r.f32[i] = ldexpf(x.f32[i], (int)e);
        }
    }
    return simde__m512_from_private(r);
}

static inline float emu_mm512_reduce_max_ps(simde__m512 v) {
    simde__m512_private a = simde__m512_to_private(v);
    float t[16];
    memcpy(t, &a, sizeof t);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] > t[i + w] ? t[i] : t[i + w];
    return t[0];
}

/* VCVTPH2PS: 16 float16 values widened to float32 (exact) */
static inline simde__m512 emu_mm512_cvtph_ps(simde__m256i h) {
    simde__m256i_private a = simde__m256i_to_private(h);
    simde__m512_private r;
    for (int i = 0; i < 16; i++) r.f32[i] = _cvtsh_ss(a.u16[i]);
    return simde__m512_from_private(r);
}

/* gcc's headers make some of these macros when not optimizing */
#undef _mm512_cvtph_ps
#undef _mm512_cvtneps_pbh
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#undef _mm512_cvtepi32_epi16
#undef _mm512_cvtepu16_epi32
#undef _mm512_cmp_epi32_mask
#undef _mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#undef _mm512_shuffle_f32x4
#undef _mm512_scalef_ps
#define _mm512_cvtneps_pbh(v) emu_mm512_cvtneps_pbh(v)
#define _mm512_maskz_loadu_ps(k, p) emu_mm512_maskz_loadu_ps((k), (p))
#define _mm512_mask_storeu_ps(p, k, v) emu_mm512_mask_storeu_ps((p), (k), (v))
#define _mm256_maskz_loadu_epi16(k, p) emu_mm256_maskz_loadu_epi16((k), (p))
#define _mm256_mask_storeu_epi16(p, k, v) emu_mm256_mask_storeu_epi16((p), (k), (v))
#define _mm512_cvtepi32_epi16(v) emu_mm512_cvtepi32_epi16(v)
#define _mm512_cvtepu16_epi32(v) emu_mm512_cvtepu16_epi32(v)
#define _mm512_srai_epi32(v, n) emu_mm512_srai_epi32((v), (n))
#define _mm512_cvtne2ps_pbh(a, b) emu_mm512_cvtne2ps_pbh((a), (b))
#define _mm512_cmp_epi32_mask(a, b, p) emu_mm512_cmp_epi32_mask((a), (b), (p))
#define _mm512_reduce_add_ps(v) emu_mm512_reduce_add_ps(v)
#define _mm512_reduce_max_ps(v) emu_mm512_reduce_max_ps(v)
#define _mm512_shuffle_f32x4(a, b, imm) simde_mm512_shuffle_f32x4((a), (b), (imm))
#define _mm512_scalef_ps(a, b) emu_mm512_scalef_ps((a), (b))
#define _mm512_cvtph_ps(h) emu_mm512_cvtph_ps(h)
#undef _mm512_cvtepu8_epi32
#undef _mm512_cvtepi8_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepu8_epi32(v) emu_mm512_cvtepu8_epi32(v)
#define _mm512_cvtepi8_epi32(v) emu_mm512_cvtepi8_epi32(v)
#define _mm512_cvtepi32_ps(v) emu_mm512_cvtepi32_ps(v)

/* -- AMX: eight tiles of up to 16 rows of 64 bytes, per thread ------------------------------- */

typedef struct {
    int rows, colsb;
    uint8_t data[16 * 64];
} emu_tile;

static _Thread_local emu_tile emu_tiles[8];

/* the 64-byte configuration: palette (byte 0), colsb[16] (bytes 16..47), rows[16] (48..63) */
static inline void emu_tile_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    for (int t = 0; t < 8; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, 2);
        emu_tiles[t].colsb = colsb > 64 ? 64 : colsb;
        emu_tiles[t].rows = c[48 + t] > 16 ? 16 : c[48 + t];
        memset(emu_tiles[t].data, 0, sizeof emu_tiles[t].data);
    }
}

static inline void emu_tile_release(void) { memset(emu_tiles, 0, sizeof emu_tiles); }

static inline void emu_tile_zero(int t) { memset(emu_tiles[t].data, 0, sizeof emu_tiles[t].data); }

static inline void emu_tile_loadd(int t, const void *base, int64_t stride) {
    emu_tile *x = &emu_tiles[t];
    memset(x->data, 0, sizeof x->data);
    for (int r = 0; r < x->rows; r++)
        memcpy(x->data + r * 64, (const uint8_t *)base + r * stride, (size_t)x->colsb);
}

static inline void emu_tile_stored(int t, void *base, int64_t stride) {
    const emu_tile *x = &emu_tiles[t];
    for (int r = 0; r < x->rows; r++)
        memcpy((uint8_t *)base + r * stride, x->data + r * 64, (size_t)x->colsb);
}

/* TDPBF16PS: c[m][n] += a[m][2k] * b[k][2n] + a[m][2k+1] * b[k][2n+1], each product exact in
 * fp32 and each sum rounded, pair by pair over k */
static inline void emu_tile_dpbf16ps(int tc, int ta, int tb) {
    emu_tile *c = &emu_tiles[tc];
    const emu_tile *a = &emu_tiles[ta], *b = &emu_tiles[tb];
    const int M = c->rows, N = c->colsb / 4, K = a->colsb / 4;
    for (int m = 0; m < M; m++) {
        float acc[16];
        memcpy(acc, c->data + m * 64, sizeof acc);
        const uint16_t *am = (const uint16_t *)(a->data + m * 64);
        for (int k = 0; k < K && k < b->rows; k++) {
            const uint16_t *bk = (const uint16_t *)(b->data + k * 64);
            const float a0 = emu_f32_of_bf16(am[2 * k]), a1 = emu_f32_of_bf16(am[2 * k + 1]);
            for (int n = 0; n < N; n++) {
                acc[n] += a0 * emu_f32_of_bf16(bk[2 * n]);
                acc[n] += a1 * emu_f32_of_bf16(bk[2 * n + 1]);
            }
        }
        memcpy(c->data + m * 64, acc, (size_t)N * 4);
    }
}

/* TDPBSUD: c[m][n] += sum over k of a[m][k] (signed bytes) * b[k/4][4n + k%4] (unsigned), in
 * int32 (exact: the sums of a tile step stay far below 2^31) */
static inline void emu_tile_dpbsud(int tc, int ta, int tb) {
    emu_tile *c = &emu_tiles[tc];
    const emu_tile *a = &emu_tiles[ta], *b = &emu_tiles[tb];
    const int M = c->rows, N = c->colsb / 4, K4 = a->colsb / 4;
    for (int m = 0; m < M; m++) {
        int32_t acc[16];
        memcpy(acc, c->data + m * 64, sizeof acc);
        const int8_t *am = (const int8_t *)(a->data + m * 64);
        for (int k = 0; k < K4 && k < b->rows; k++) {
            const uint8_t *bk = b->data + k * 64;
            for (int n = 0; n < N; n++)
                for (int i = 0; i < 4; i++) acc[n] += (int32_t)am[4 * k + i] * bk[4 * n + i];
        }
        memcpy(c->data + m * 64, acc, (size_t)N * 4);
    }
}

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#undef _tile_dpbsud
#define _tile_loadconfig(config) emu_tile_loadconfig(config)
#define _tile_release() emu_tile_release()
#define _tile_zero(t) emu_tile_zero(t)
#define _tile_loadd(t, base, stride) emu_tile_loadd((t), (base), (int64_t)(stride))
#define _tile_stored(t, base, stride) emu_tile_stored((t), (void *)(base), (int64_t)(stride))
#define _tile_dpbf16ps(c, a, b) emu_tile_dpbf16ps((c), (a), (b))
#define _tile_dpbsud(c, a, b) emu_tile_dpbsud((c), (a), (b))

#endif
