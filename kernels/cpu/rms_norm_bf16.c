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
 * torch's by an ulp of float32 and a result by one bfloat16 ulp where it falls near a rounding boundary.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (int64_t)r * n;
        uint16_t *yr = y + (int64_t)r * n;
        float ss = 0.0f;
        for (int i = 0; i < n; i++) {
            const float v = widen(xr[i]);
            ss += v * v;
        }
        const float scale = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) yr[i] = narrow(widen(narrow(widen(xr[i]) * scale)) * widen(w[i]));
    }
}
