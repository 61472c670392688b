/* RMSNorm of bfloat16 rows on the CPU, as the reference computes it, in one pass per row instead of four
 * torch ops (widen, normalise, narrow, scale: ~18 us a call at one row of 576, dispatch more than work).
 * Built and loaded by kernels/cpu_rms_norm.py.
 *
 *   r = 1 / sqrt(mean(x^2) + eps)        in float32 (x widened exactly)
 *   y = bf16( float(bf16(x * r)) * w )   the normalised row rounded to bfloat16 first, then scaled by the
 *                                        bfloat16 weight and rounded again, like `w * rms(x).to(bf16)`
 *
 * Rounding: to nearest, ties to even, as torch rounds (NaN stays NaN). The sum of squares runs in float32,
 * 16 lanes at a time with AVX-512 (torch's own reduction order differs), so r may differ from
 * torch's by an ulp of float32, the normalised value by one bfloat16 ulp where it falls near a rounding
 * boundary, and its product with the weight then by up to two.
 *
 * `add_rms_norm_bf16` first adds a residual branch into the rows in place, h = bf16(h + a) (float32 sum of the
 * two exact values, rounded as torch's bfloat16 `add_` rounds it, so h is bit-identical), then normalises the
 * new rows as above: a decoder layer's `h += branch; x = norm(h)` in one pass over h where torch's add and the
 * kernel above made two calls and two passes (the row is then read again from L1).
 * AVX-512: 16 values a step in every loop (bits.h's `round_bf16` rounds as `float_to_bf16` does). On a 2-core
 * AMD EPYC VM, C alone, 64 rows of 576: the norm 13.3 -> 12.3 us against the scalar loops as the compiler
 * vectorised them, the add and norm 19.2 -> 17.1 (0.3 ns a value); the call from Python adds ~7 us.
 * AVX2 without AVX-512: the same loops on 8 lanes (bits.h's `round_bf16x8`); the sum of squares then in 8
 * lanes, another order again.
 *
 * `add_rms_norm_f32` is the float32 twin for the float32 decode layers (decode_layers.c): h += a, then
 * y = (h * r) * w with r as above, every value float32 (torch's `F.rms_norm` on float32 rows computes the same
 * products; its reduction order differs, so r may differ by an ulp).
 */
#include <math.h>
#include <stdint.h>

#include "bits.h"
#include "pool.h"

/* The sum of squares of a row (float32) */
static inline float sum_squares(const uint16_t *xr, int n) {
    float ss = 0.0f;
    int i = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = bf16x16_to_float(xr + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = bf16x8_to_float(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum8(acc);
#endif
    for (; i < n; i++) {
        const float v = bf16_to_float(xr[i]);
        ss += v * v;
    }
    return ss;
}

/* yr = bf16(float(bf16(xr * scale)) * w) */
static inline void scale_row(const uint16_t *xr, const uint16_t *w, uint16_t *yr, int n, float scale) {
    int i = 0;
#ifdef __AVX512F__
    const __m512 sv = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16)
        store_bf16x16(yr + i, _mm512_mul_ps(bf16_round16(_mm512_mul_ps(bf16x16_to_float(xr + i), sv)),
                                            bf16x16_to_float(w + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 sv = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8)
        store_bf16x8(yr + i, _mm256_mul_ps(bf16_round8(_mm256_mul_ps(bf16x8_to_float(xr + i), sv)),
                                           bf16x8_to_float(w + i)));
#endif
    for (; i < n; i++) {
        const float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * scale));
        yr[i] = float_to_bf16(normed * bf16_to_float(w[i]));
    }
}

typedef struct {
    uint16_t *h; /* x of the plain norm (not written), h of the add-and-norm */
    const uint16_t *a, *w; /* a: the branch added into h, NULL for the plain norm */
    uint16_t *y;
    int n;
    float eps;
} Job;

static void norm_rows(void *ctx, int64_t r0, int64_t r1) {
    const Job *j = (const Job *)ctx;
    const int n = j->n;
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *hr = j->h + r * n;
        if (j->a) {
            const uint16_t *ar = j->a + r * n;
            int i = 0;
#ifdef __AVX512F__
            for (; i + 16 <= n; i += 16)
                store_bf16x16(hr + i, _mm512_add_ps(bf16x16_to_float(hr + i), bf16x16_to_float(ar + i)));
#elif defined(__AVX2__) && defined(__FMA__)
            for (; i + 8 <= n; i += 8)
                store_bf16x8(hr + i, _mm256_add_ps(bf16x8_to_float(hr + i), bf16x8_to_float(ar + i)));
#endif
            for (; i < n; i++) hr[i] = float_to_bf16(bf16_to_float(hr[i]) + bf16_to_float(ar[i]));
        }
        scale_row(hr, j->w, j->y + r * n, n, 1.0f / sqrtf(sum_squares(hr, n) / (float)n + j->eps));
    }
}

/* Both on the shared pool (pool.h's `pool_rows`) where the call is large enough. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int n, float eps, int threads,
                   int linger) {
    Job job = {(uint16_t *)x, NULL, w, y, n, eps};
    pool_rows(norm_rows, &job, rows, n, threads, linger);
}

void add_rms_norm_bf16(uint16_t *h, const uint16_t *a, const uint16_t *w, uint16_t *y, int rows, int n,
                       float eps, int threads, int linger) {
    Job job = {h, a, w, y, n, eps};
    pool_rows(norm_rows, &job, rows, n, threads, linger);
}

typedef struct {
    float *h;
    const float *a, *w;
    float *y;
    int n;
    float eps;
} JobF32;

static void add_norm_rows_f32(void *ctx, int64_t r0, int64_t r1) {
    const JobF32 *j = (const JobF32 *)ctx;
    const int n = j->n;
    for (int64_t r = r0; r < r1; r++) {
        float *hr = j->h + r * n, *yr = j->y + r * n;
        const float *ar = j->a + r * n, *w = j->w;
        float ss = 0.0f;
        int i = 0;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_add_ps(_mm512_loadu_ps(hr + i), _mm512_loadu_ps(ar + i));
            _mm512_storeu_ps(hr + i, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(hr + i), _mm256_loadu_ps(ar + i));
            _mm256_storeu_ps(hr + i, v);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hsum8(acc);
#endif
        for (; i < n; i++) {
            hr[i] += ar[i];
            ss += hr[i] * hr[i];
        }
        const float scale = 1.0f / sqrtf(ss / (float)n + j->eps);
        for (i = 0; i < n; i++) yr[i] = hr[i] * scale * w[i]; /* the compiler vectorises this one */
    }
}

/* h [rows, n] += a, y = rms_norm(h) * w, float32; rows on the shared pool where the call is large enough. */
void add_rms_norm_f32(float *h, const float *a, const float *w, float *y, int rows, int n, float eps, int threads,
                      int linger) {
    JobF32 job = {h, a, w, y, n, eps};
    pool_rows(add_norm_rows_f32, &job, rows, n, threads, linger);
}
