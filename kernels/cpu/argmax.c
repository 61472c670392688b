/* Row-wise argmax of float32 or bfloat16 rows, as torch.argmax(dim=-1) answers it: the first index of the
 * maximum, and a NaN counts as the maximum (the first NaN's index). Built and loaded by kernels/cpu_argmax.py.
 *
 * Grammar masks (backend/grammar.py: int32 words, bit i of word w set when token 32 w + i is allowed): with
 * `words`, a row's argmax is that of the row with every forbidden token at -inf, as torch answers it after
 * the sampler's masked_fill (a forbidden NaN is -inf too; a row with nothing allowed gives 0), without
 * building that row: each loaded vector is blended with -inf under its lanes' bits. `mask_fill_rows` writes
 * the -inf into float32 rows in place, for rows that are sampled rather than taken greedily: torch's
 * bit unpacking and masked_fill took 11-13 ms for 32 rows of 49,152 (2-core AMD EPYC VM).
 *
 * Greedy decoding takes one argmax per sampled row over the vocabulary (49,152 for SmolLM2): torch's CPU
 * argmax ran at ~3 GB/s on one thread (1.1-1.9 ms a step for 32 rows). Here a row is read twice: a vector
 * max that also notes any NaN, then a vector compare for the first index equal to the max (the row is in
 * L2 by then). bfloat16 rows (the LM head's own output, before any float32 copy) are widened exactly on
 * load, 16 values at a time, so they give the answer of the float32 copy. With AVX2 but no AVX-512 the same
 * passes on 8 lanes; without either, plain loops.
 */
#include <math.h>
#include <stdint.h>

#include "bits.h"
#include "pool.h"

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 values from i as float32: float32 rows as they are, bfloat16 rows widened (exact) */
static inline __attribute__((always_inline)) __m512 load16(const void *x, int64_t i, const int half,
                                                           const int32_t *words) {
    const __m512 v = half ? bf16x16_to_float((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
    if (!words) return v;
    const __mmask16 allowed = (__mmask16)((uint32_t)words[i >> 5] >> (i & 31)); /* i is a multiple of 16 */
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), allowed, v);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 values from i as float32 (AVX2: the same scans on 8 lanes) */
static inline __attribute__((always_inline)) __m256 load8(const void *x, int64_t i, const int half,
                                                          const int32_t *words) {
    const __m256 v = half ? bf16x8_to_float((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
    if (!words) return v;
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i bits = _mm256_set1_epi32((int)(((uint32_t)words[i >> 5] >> (i & 31)) & 0xff)); /* i % 8 == 0 */
    const __m256i allowed = _mm256_cmpeq_epi32(_mm256_and_si256(bits, lane), lane);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, _mm256_castsi256_ps(allowed));
}
#endif

static inline int allowed_at(const int32_t *words, int64_t i) {
    return ((uint32_t)words[i >> 5] >> (i & 31)) & 1;
}

static inline __attribute__((always_inline)) float at(const void *x, int64_t i, const int half,
                                                      const int32_t *words) {
    if (words && !allowed_at(words, i)) return -INFINITY;
    return half ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* words: the row's mask words, or NULL for none */
static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int64_t n, const int half,
                                                                const int32_t *words) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nans = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, i, half, words);
        nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(v, vm); /* a NaN in v gives vm's lane back */
    }
    m = _mm512_reduce_max_ps(vm);
    nan = nans != 0;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 vm = _mm256_set1_ps(-INFINITY), nans = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, i, half, words);
        nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(v, vm); /* a NaN in v gives vm's lane back */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    nan = _mm256_movemask_ps(nans) != 0;
#endif
    for (; i < n; i++) {
        const float v = at(x, i, half, words);
        nan |= v != v;
        m = v > m ? v : m;
    }
    i = 0;
    if (nan) {
        for (; i < n; i++)
            if (at(x, i, half, words) != at(x, i, half, words)) return i;
    }
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(load16(x, i, half, words), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, i, half, words), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (at(x, i, half, words) == m) return i;
    return 0; /* not reached: m is one of the row's values (or -inf for a row of -inf, found at 0) */
}

typedef struct {
    const void *x;
    int64_t *out;
    int64_t n;
    int half;
    const int32_t *words;
} ArgmaxJob;

static void argmax_run(void *ctx, int64_t r0, int64_t r1) {
    const ArgmaxJob *j = (const ArgmaxJob *)ctx;
    const int64_t row_bytes = j->n * (j->half ? 2 : 4), row_words = (j->n + 31) / 32;
    for (int64_t r = r0; r < r1; r++) {
        const void *row = (const char *)j->x + r * row_bytes;
        const int32_t *w = j->words ? j->words + r * row_words : NULL;
        if (w)
            j->out[r] = j->half ? argmax_row(row, j->n, 1, w) : argmax_row(row, j->n, 0, w);
        else
            j->out[r] = j->half ? argmax_row(row, j->n, 1, NULL) : argmax_row(row, j->n, 0, NULL);
    }
}

/* half: 1 for bfloat16 rows, 0 for float32; words: NULL, or rows x ceil(n / 32) mask words (every row masked).
 * Rows are shared out over the helper pool (pool.h's `pool_rows`) where the call is large enough. */
void argmax_rows(const void *x, int64_t *out, int rows, int64_t n, int half, const int32_t *words, int threads,
                 int linger) {
    ArgmaxJob job = {x, out, n, half, words};
    pool_rows(argmax_run, &job, rows, n, threads, linger);
}

/* Every token a row's mask words forbid set to -inf in float32 rows [rows, n], in place; a word of all ones
 * (32 allowed tokens, most of a free-text stretch) is skipped whole. */
void mask_fill_rows(float *x, int rows, int64_t n, const int32_t *words) {
    const int64_t row_words = (n + 31) / 32;
    for (int r = 0; r < rows; r++) {
        float *row = x + r * n;
        const int32_t *w = words + r * row_words;
        for (int64_t k = 0; k < row_words; k++) {
            uint32_t forbidden = ~(uint32_t)w[k];
            while (forbidden) {
                const int64_t i = 32 * k + __builtin_ctz(forbidden);
                if (i >= n) break;
                row[i] = -INFINITY;
                forbidden &= forbidden - 1;
            }
        }
    }
}
