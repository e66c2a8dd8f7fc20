/* The 8-lane vector helpers of the AVX2 kernels (kernels_avx2.c, kernels_quant_avx2.c): loads
 * and stores of float32 or bfloat16 values (bfloat16 widened to fp32 on load by a 16-bit shift,
 * rounded to nearest even on store), sums and maxima across lanes, and exp. Everything here is
 * compiled for AVX2 + FMA + F16C through a target attribute, so the files that include it build on any
 * x86-64 compiler and run only where the level is chosen. */
#ifndef SGL_VEC_AVX2_H
#define SGL_VEC_AVX2_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c"))) /* F16C: float16 scales */
#define INLINE static inline __attribute__((always_inline))

/* -- vectors of 8 values ------------------------------------------------------------------- */

/* 8 values at p as fp32 (dtype 1: bfloat16, 0: float32) */
AVX2_TARGET INLINE __m256 load8(const void *p, int dtype) {
    if (dtype)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* the first n values at p (all 8 when n >= 8), zero in the lanes past them */
AVX2_TARGET INLINE __m256 load8n(const void *p, int64_t n, int dtype) {
    if (n >= 8) return load8(p, dtype);
    uint32_t buf[8] = {0};
    if (n > 0) memcpy(buf, p, (size_t)(n * (dtype ? 2 : 4)));
    return load8(buf, dtype);
}

/* v rounded to the nearest bfloat16 (ties to even) as fp32 bit patterns; NaN stays a NaN */
AVX2_TARGET INLINE __m256i bf16_bits(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
}

/* fp32 -> nearest bfloat16 -> fp32 */
AVX2_TARGET INLINE __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(bf16_bits(v)); }

AVX2_TARGET INLINE void store8(void *p, __m256 v, int dtype) {
    if (dtype) {
        const __m256i r = _mm256_srli_epi32(bf16_bits(v), 16);
        _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                        _mm256_extracti128_si256(r, 1)));
    } else {
        _mm256_storeu_ps((float *)p, v);
    }
}

/* the first n lanes of v to p (all 8 when n >= 8) */
AVX2_TARGET INLINE void store8n(void *p, __m256 v, int64_t n, int dtype) {
    if (n >= 8) {
        store8(p, v, dtype);
        return;
    }
    uint32_t buf[8];
    store8(buf, v, dtype);
    if (n > 0) memcpy(p, buf, (size_t)(n * (dtype ? 2 : 4)));
}

AVX2_TARGET INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2_TARGET INLINE float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* lane i of the result = the sum of the 8 lanes of v[i] */
AVX2_TARGET INLINE __m256 sum8x8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: the low-half sums of v[0..3], then their high-half sums; u1 likewise for v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* e^x: the reduction and polynomial of kernels_avx512.c's exp, 2^n built from its bits (in two
   factors, so that n = 128 does not overflow the exponent); 0 below FLT_MIN, inf above FLT_MAX,
   NaN for NaN */
AVX2_TARGET INLINE __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365448f), hi = _mm256_set1_ps(88.7228391f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), bias = _mm256_set1_epi32(127);
    const __m256i n1 = _mm256_min_epi32(ni, bias);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, n1), bias), 23));
    __m256 e = _mm256_andnot_ps(under, _mm256_mul_ps(_mm256_mul_ps(p, s1), s2));
    e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), over);
    return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

#endif
