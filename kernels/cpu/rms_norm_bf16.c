/* RMSNorm of bfloat16 rows on the CPU, as the reference computes it, in one pass per row instead of four
 * torch ops (widen, normalise, narrow, scale: ~18 us a call at one row of 576, dispatch more than work).
 * Built and loaded by kernels/cpu_rms_norm.py.
 *
 *   r = 1 / sqrt(mean(x^2) + eps)        in float32 (x widened exactly)
 *   y = bf16( float(bf16(x * r)) * w )   the normalised row rounded to bfloat16 first, then scaled by the
 *                                        bfloat16 weight and rounded again, like `w * rms(x).to(bf16)`
 *
 * Rounding: to nearest, ties to even, as torch rounds (NaN stays NaN). The sum of squares runs in float32
 * in the order the compiler vectorises it (torch's own reduction order differs), so r may differ from
 * torch's by an ulp of float32, the normalised value by one bfloat16 ulp where it falls near a rounding
 * boundary, and its product with the weight then by up to two.
 *
 * `add_rms_norm_bf16` first adds a residual branch into the rows in place, h = bf16(h + a) (float32 sum of the
 * two exact values, rounded as torch's bfloat16 `add_` rounds it, so h is bit-identical), then normalises the
 * new rows as above: a decoder layer's `h += branch; x = norm(h)` in one pass over h where torch's add and the
 * kernel above made two calls and two passes.
 */
#include <math.h>
#include <stdint.h>

#include "bits.h"


void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (int64_t)r * n;
        uint16_t *yr = y + (int64_t)r * n;
        float ss = 0.0f;
        for (int i = 0; i < n; i++) {
            const float v = bf16_to_float(xr[i]);
            ss += v * v;
        }
        const float scale = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) {
            const float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * scale));
            yr[i] = float_to_bf16(normed * bf16_to_float(w[i]));
        }
    }
}

void add_rms_norm_bf16(uint16_t *h, const uint16_t *a, const uint16_t *w, uint16_t *y, int rows, int n,
                       float eps) {
    for (int r = 0; r < rows; r++) {
        uint16_t *hr = h + (int64_t)r * n;
        const uint16_t *ar = a + (int64_t)r * n;
        for (int i = 0; i < n; i++) hr[i] = float_to_bf16(bf16_to_float(hr[i]) + bf16_to_float(ar[i]));
    }
    rms_norm_bf16(h, w, y, rows, n, eps);
}
