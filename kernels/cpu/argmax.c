/* Row-wise argmax of float32 rows, as torch.argmax(dim=-1) answers it: the first index of the maximum, and a
 * NaN counts as the maximum (the first NaN's index). Built and loaded by kernels/cpu_argmax.py.
 *
 * Greedy decoding takes one argmax per sampled row over the vocabulary (49,152 for SmolLM2): torch's CPU
 * argmax ran at ~3 GB/s on one thread (1.1-1.9 ms a step for 32 rows). Here a row is read twice: a vector
 * max that also notes any NaN, then a vector compare for the first index equal to the max (the row is in
 * L2 by then). Without AVX-512 both passes are plain loops.
 */
#include <math.h>
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

static int64_t argmax_row(const float *x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nans = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(v, vm); /* a NaN in v gives vm's lane back */
    }
    m = _mm512_reduce_max_ps(vm);
    nan = nans != 0;
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    i = 0;
    if (nan) {
        for (; i < n; i++)
            if (x[i] != x[i]) return i;
    }
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0; /* not reached: m is one of the row's values (or -inf for a row of -inf, found at 0) */
}

void argmax_rows(const float *x, int64_t *out, int rows, int64_t n) {
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * n, n);
}
