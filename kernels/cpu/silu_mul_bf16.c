/* SwiGLU's activation of bfloat16 rows in one pass: y = silu(gate) * up, for gate_up [T, 2I] (gate the first I
 * columns of a row, up the last I) into y [T, I]. Built and loaded by kernels/cpu_silu_mul.py.
 *
 * Roundings as torch's `F.silu(gate).mul_(up)` on bfloat16: silu in float32, rounded to bfloat16; the product
 * of that and up in float32, rounded to bfloat16 (to nearest, ties to even, both). silu(x) = x * sigmoid(x)
 * from one e = e^-|x| (never overflows): x / (1 + e) for x >= 0, x e / (1 + e) below; torch divides x by
 * 1 + e^-x, the same value up to float32 rounding, so the bfloat16 results agree but for the rare element
 * whose float32 silu sits at a bfloat16 rounding boundary (one bfloat16 step then). Below -ln(FLT_MAX), where
 * torch's e^-x overflows, its silu is x / inf = -0, and so is this one (the true value, ~-2e-37 at -89, is
 * not what the reference computes).
 * e^t for t <= 0: bits.h's `exp_reduced` (e^r for the reduced argument, and n), times 2^n as 2^(n + 100)
 * 2^-100 so that results down in the float32 subnormals stay right; below -104 it is 0, as e^-104 is under
 * half the smallest subnormal.
 * With AVX-512, 4 x 16 lanes at a time with the same operations (the scalar code takes the row's tail, and
 * other CPUs). Measured on a 2-core AMD EPYC VM, one thread, 320 rows of 1536: 0.62 ns an element, torch's
 * two ops 0.75-0.85 (16 lanes at a time: 0.81, the one long dependency chain per vector did not overlap);
 * a SmolLM2 layer at 32 rows 42-54 -> 37 us, at one row 10 -> 6.6 us (most of that the call itself).
 * With AVX2 and FMA but no AVX-512, 4 x 8 lanes, the same operations again (bit for bit the scalar code's
 * results, NaN and infinities included, checked against a build without AVX2): on a 2-core AMD EPYC VM (Zen 3),
 * one thread, 64 rows of 1536, 1.53 ns an element where the scalar code took 9.73.
 * `silu_mul_f32` is the float32 twin for the float32 decode layers (decode_layers.c): the same silu, times up,
 * no rounding to bfloat16 between (torch's `F.silu(gate) * up` on float32 rows, up to float32 rounding);
 * `silu_mul_bf16_once` takes and gives bfloat16 but rounds only the product (float32 compute around INT4 GEMVs).
 */
#include <math.h>
#include <stdint.h>

#include "bits.h"
#include "pool.h"

static inline float exp_neg(float t) { /* e^t for t <= 0 (`exp_reduced`, bits.h), down into the subnormals */
    float n;
    const float p = exp_reduced(t < -104.0f ? -104.0f : t, &n);
    const float e = p * bits_to_float((uint32_t)((int32_t)n + 100 + 127) << 23) * 0x1p-100f;
    return t < -104.0f ? 0.0f : e;
}

static inline float silu(float x) {
    const float e = exp_neg(-fabsf(x));
    const float s = (x >= 0.0f ? x : x * e) / (1.0f + e);
    return x < -88.72283935546875f ? x * 0.0f : s; /* torch's e^-x is inf there: x / inf, a signed zero */
}

/* `once`: silu not rounded to bfloat16 before the product (silu_mul_bf16_once) */
static inline uint16_t silu_mul(uint16_t g, uint16_t u, const int once) {
    const float s = silu(bf16_to_float(g));
    return float_to_bf16((once ? s : bf16_to_float(float_to_bf16(s))) * bf16_to_float(u));
}

#ifdef __AVX512F__
#include <immintrin.h>

/* silu of 16 lanes: the same operations as the scalar code, lane by lane */
static inline __attribute__((always_inline)) __m512 silu16(__m512 x) {
    const __m512 t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000)));
    const __m512 tc = _mm512_max_ps(t, _mm512_set1_ps(-104.0f)); /* -|x| >= -104 */
    __m512 n;
    const __m512 p = exp_reduced16(tc, &n);
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(100 + 127)), 23));
    const __m512 e = _mm512_mul_ps(_mm512_mul_ps(p, scale), _mm512_set1_ps(0x1p-100f));
    const __m512 ek = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), e,
                                           _mm512_setzero_ps());
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ); /* not NaN, not +-0 */
    const __m512 num = _mm512_mask_mul_ps(x, neg, x, ek);
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), ek));
    const __mmask16 flush = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.72283935546875f), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(s, flush, x, _mm512_setzero_ps());
}

/* U x 16 lanes of silu_mul; U independent vectors side by side (unrolled), so the long dependency chain of one
 * (~30 operations) overlaps the others' */
#define U 4
static inline __attribute__((always_inline)) void silu_mul16(const uint16_t *gp, const uint16_t *up, uint16_t *out,
                                                             const int once) {
    __m512 s[U];
    for (int k = 0; k < U; k++) s[k] = silu16(bf16x16_to_float(gp + 16 * k));
    for (int k = 0; k < U; k++)
        store_bf16x16(out + 16 * k, _mm512_mul_ps(once ? s[k] : bf16_round16(s[k]), bf16x16_to_float(up + 16 * k)));
}

static inline __attribute__((always_inline)) void silu_mul16_f32(const float *gp, const float *up, float *out) {
    __m512 s[U];
    for (int k = 0; k < U; k++) s[k] = silu16(_mm512_loadu_ps(gp + 16 * k));
    for (int k = 0; k < U; k++) _mm512_storeu_ps(out + 16 * k, _mm512_mul_ps(s[k], _mm512_loadu_ps(up + 16 * k)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* silu16 on 8 lanes (AVX2 and FMA): the same operations, comparisons as all-ones lanes and blends */
static inline __attribute__((always_inline)) __m256 silu8(__m256 x) {
    const __m256 t = _mm256_or_ps(x, _mm256_set1_ps(-0.0f));
    const __m256 tc = _mm256_max_ps(t, _mm256_set1_ps(-104.0f)); /* -|x| >= -104 */
    __m256 n;
    const __m256 p = exp_reduced8(tc, &n);
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(100 + 127)), 23));
    const __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, scale), _mm256_set1_ps(0x1p-100f));
    const __m256 ek = _mm256_andnot_ps(_mm256_cmp_ps(t, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), e);
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ); /* not NaN, not +-0 */
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, ek), neg);
    const __m256 s = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), ek));
    const __m256 flush = _mm256_cmp_ps(x, _mm256_set1_ps(-88.72283935546875f), _CMP_LT_OQ);
    return _mm256_blendv_ps(s, _mm256_mul_ps(x, _mm256_setzero_ps()), flush);
}

#define U 4
static inline __attribute__((always_inline)) void silu_mul8(const uint16_t *gp, const uint16_t *up, uint16_t *out,
                                                            const int once) {
    __m256 s[U];
    for (int k = 0; k < U; k++) s[k] = silu8(bf16x8_to_float(gp + 8 * k));
    for (int k = 0; k < U; k++)
        store_bf16x8(out + 8 * k, _mm256_mul_ps(once ? s[k] : bf16_round8(s[k]), bf16x8_to_float(up + 8 * k)));
}

static inline __attribute__((always_inline)) void silu_mul8_f32(const float *gp, const float *up, float *out) {
    __m256 s[U];
    for (int k = 0; k < U; k++) s[k] = silu8(_mm256_loadu_ps(gp + 8 * k));
    for (int k = 0; k < U; k++) _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(s[k], _mm256_loadu_ps(up + 8 * k)));
}
#endif

typedef struct {
    const uint16_t *gate_up;
    uint16_t *y;
    int64_t inter;
} Job;

static inline __attribute__((always_inline)) void rows_bf16(const Job *j, int64_t r0, int64_t r1, const int once) {
    const int64_t inter = j->inter;
    for (int64_t t = r0; t < r1; t++) {
        const uint16_t *g = j->gate_up + t * 2 * inter, *u = g + inter;
        uint16_t *out = j->y + t * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 * U <= inter; i += 16 * U) silu_mul16(g + i, u + i, out + i, once);
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 * U <= inter; i += 8 * U) silu_mul8(g + i, u + i, out + i, once);
#endif
        for (; i < inter; i++) out[i] = silu_mul(g[i], u[i], once);
    }
}

static void silu_mul_rows(void *ctx, int64_t r0, int64_t r1) { rows_bf16((const Job *)ctx, r0, r1, 0); }
static void silu_mul_rows_once(void *ctx, int64_t r0, int64_t r1) { rows_bf16((const Job *)ctx, r0, r1, 1); }

/* Rows on the shared pool (pool.h's `pool_rows`) where the call is large enough. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter, int threads, int linger) {
    Job job = {gate_up, y, inter};
    pool_rows(silu_mul_rows, &job, rows, inter, threads, linger);
}

/* The same with one rounding: silu(gate) * up in float32, rounded to bfloat16 once (what torch computes on
 * bfloat16 rows widened to float32, the product then cast to bfloat16: a float32 model's INT4 experts, whose
 * GEMVs take and give bfloat16). */
void silu_mul_bf16_once(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter, int threads, int linger) {
    Job job = {gate_up, y, inter};
    pool_rows(silu_mul_rows_once, &job, rows, inter, threads, linger);
}

typedef struct {
    const float *gate_up;
    float *y;
    int64_t inter;
} JobF32;

static void silu_mul_rows_f32(void *ctx, int64_t r0, int64_t r1) {
    const JobF32 *j = (const JobF32 *)ctx;
    const int64_t inter = j->inter;
    for (int64_t t = r0; t < r1; t++) {
        const float *g = j->gate_up + t * 2 * inter, *u = g + inter;
        float *out = j->y + t * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 * U <= inter; i += 16 * U) silu_mul16_f32(g + i, u + i, out + i);
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 * U <= inter; i += 8 * U) silu_mul8_f32(g + i, u + i, out + i);
#endif
        for (; i < inter; i++) out[i] = silu(g[i]) * u[i];
    }
}

/* y [rows, I] = silu(gate) * up of gate_up [rows, 2I], float32; rows on the shared pool where large enough. */
void silu_mul_f32(const float *gate_up, float *y, int64_t rows, int64_t inter, int threads, int linger) {
    JobF32 job = {gate_up, y, inter};
    pool_rows(silu_mul_rows_f32, &job, rows, inter, threads, linger);
}
