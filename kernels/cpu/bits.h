/* Float bit helpers the CPU kernels share (a header: each kernel is its own shared object). kernels/cpu_build.py
 * keys every build by the headers here too, so a change to this file rebuilds the kernels. */
#ifndef EDGESERVE_BITS_H
#define EDGESERVE_BITS_H
#include <stdint.h>
#include <string.h>

static inline float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* 2^e exactly, for e in [-128, 127] (int8 exponents): normal for e >= -126, the two subnormals below it. */
static inline float pow2i(int e) {
    return e >= -126 ? bits_to_float((uint32_t)(e + 127) << 23) : bits_to_float(0x00800000u >> (-126 - e));
}

/* e^x = exp_reduced(x, &n) * 2^n for finite |x| <= 104, branch-free so loops over it vectorise (glibc's expf
 * is a call per element): x = n ln2 + r with n = rint(x / ln2) and r from two fused steps (Cody-Waite: ln2
 * split in a high part with trailing zeros and a low part), |r| <= ln2 / 2; e^r by its Taylor polynomial to
 * r^7 (truncation < 2e-8 relative). The caller applies 2^n as its range needs (paged_decode.c's softmax,
 * silu_mul_bf16.c's SiLU). */
static inline float exp_reduced(float x, float *n_out) {
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = __builtin_fmaf(n, -0.693145751953125f, x); /* ln2's high 16 bits: n * hi is exact */
    r = __builtin_fmaf(n, -1.42860682030941723e-06f, r);
    float p = 1.0f / 5040.0f;
    p = __builtin_fmaf(p, r, 1.0f / 720.0f);
    p = __builtin_fmaf(p, r, 1.0f / 120.0f);
    p = __builtin_fmaf(p, r, 1.0f / 24.0f);
    p = __builtin_fmaf(p, r, 1.0f / 6.0f);
    p = __builtin_fmaf(p, r, 0.5f);
    p = __builtin_fmaf(p, r, 1.0f);
    p = __builtin_fmaf(p, r, 1.0f);
    *n_out = n;
    return p;
}

/* bfloat16 -> float32: exact (the 16 bits on top). */
static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

#ifdef __AVX512F__
#include <immintrin.h>

/* [sum(a), sum(b), sum(c), sum(d)] of 4 x 16 lanes: 13 vector ops where four `_mm512_reduce_add_ps` take ~32 (the
 * GEMVs' tiles reduce four sums at once). AVX-512F only (the upper half taken as 4 doubles, not AVX512DQ's 8
 * floats). */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* a b a b per 128 */
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2))); /* a b c d per 128 */
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* exp_reduced on 16 lanes: the same operations lane by lane (the same constants), n returned in *n_out. */
static inline __m512 exp_reduced16(__m512 x, __m512 *n_out) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.42860682030941723e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    *n_out = n;
    return p;
}

/* 16 bfloat16 values at p -> float32, exactly (the 16 bits on top of each lane). */
static inline __m512 bf16x16_to_float(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* float_to_bf16 (below) on 16 lanes, in the low halves of the 32-bit lanes (integer rounding: keeps subnormals,
 * which vcvtneps2bf16 would flush) */
static inline __m512i round_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* 16 lanes rounded to bfloat16 as above, stored at p */
static inline void store_bf16x16(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(round_bf16(f)));
}

/* 16 lanes rounded to bfloat16 and widened back: the float32 values the stored bfloat16 would read as */
static inline __m512 bf16_round16(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(f), 16)); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_reduced on 8 lanes (AVX2 and FMA): the same operations lane by lane (the same constants). */
static inline __m256 exp_reduced8(__m256 x, __m256 *n_out) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.42860682030941723e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    *n_out = n;
    return p;
}

/* The sum of 8 lanes (halves added, then pairs) */
static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* 8 bfloat16 values at p -> float32, exactly */
static inline __m256 bf16x8_to_float(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* float_to_bf16 (below) on 8 lanes, in the low halves of the 32-bit lanes (integer rounding, as round_bf16) */
static inline __m256i round_bf16x8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}

/* 8 lanes rounded to bfloat16 as above, stored at p */
static inline void store_bf16x8(uint16_t *p, __m256 f) {
    const __m256i r = round_bf16x8(f);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* 8 lanes rounded to bfloat16 and widened back: the float32 values the stored bfloat16 would read as */
static inline __m256 bf16_round8(__m256 f) { return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16x8(f), 16)); }
#endif

/* float32 -> bfloat16: to nearest, ties to even, as torch rounds; NaN stays NaN (quiet, its sign kept). */
static inline uint16_t float_to_bf16(float f) {
    const uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif
