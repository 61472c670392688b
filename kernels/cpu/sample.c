/* Temperature sampling of float32 or bfloat16 logit rows by inverting the softmax's CDF, in three passes
 * over a row and no copy of it, with top-k and top-p cuts found in place. Built and loaded by
 * kernels/cpu_sample.py; backend/sampler.py calls it.
 *
 * A row's token is drawn with probability softmax(x / T) by inverting its CDF with one uniform u per row
 * (drawn by the caller, from the request's own generator when it has a seed): the first token whose
 * running sum of e_i = exp((x_i - m) / T) (m the row's maximum, so every e_i <= 1 and the maximum's is 1)
 * exceeds u times the total. Pass 1 finds m; pass 2 sums e_i per word of 32 tokens into a double per word
 * (the total is their running sum); pass 3 walks those sums to the word where the running sum passes
 * u * total and recomputes that word's 32 values to find the token. A token of probability 0 (forbidden
 * by a grammar mask word, or -inf: cut by top-k or top-p) is never drawn; one whose e_i falls below
 * float32's normal range (x_i more than 87 T below the maximum, a probability under 1.6e-38) counts as 0.
 * The sum of a word's 32 float32 values rounds at float32 (relative 2e-7 of that word's mass); the words'
 * sums are added in double. e_i is exp_reduced (bits.h) with its 2^n applied by exponent bits, on 8 lanes
 * where the host has AVX2 and FMA (AVX-512 hosts too: the row is read three times, at most, and the exps
 * bound it, not the width), else a scalar loop.
 *
 * top-k and top-p (as backend/sampler.py's torch path answers them, ties with the last kept token kept): a
 * cut value per row, and every allowed token >= it is kept. top-k's is the k-th largest allowed value, from a
 * min-heap of k over one pass. top-p's comes from the weights of the tokens top-k kept binned by
 * (m - x) / T (1,024 buckets over the 87 where weights are nonzero): the buckets before the one where the
 * running mass passes p times the total are kept whole, and only that bucket's tokens are sorted (torch
 * sorts the whole row: ~80 ms for 32 rows of 49,152 on a 2-core VM).
 *
 * Grammar masks are backend/grammar.py's int32 words (bit i of word w set when token 32 w + i is allowed).
 * A row with a NaN among its allowed tokens takes the first such NaN (as the argmax would), one with +inf
 * its first +inf; a row with no allowed token, 0.
 *
 * torch's path for 32 rows of 49,152 (the float32 copy of bfloat16 logits, division by T, softmax, a
 * float64 running sum, searchsorted) took ~20 ms on a 2-core AMD EPYC VM; the exponential race before it,
 * 47-49 ms.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bits.h"
#include "pool.h"

static inline __attribute__((always_inline)) float value(const void *x, int64_t i, const int half) {
    return half ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* e^y for y <= 0 (0 below -87, where e^y leaves float32's normal range), times `keep` (0 or 1): arithmetic
 * rather than branches, so loops over it vectorise */
static inline float exp_nonpositive(float y, float keep) {
    const float c = __builtin_fmaxf(y, -87.0f);
    float n;
    const float p = exp_reduced(c, &n);
    const float e = p * bits_to_float((uint32_t)((int32_t)n + 127) << 23);
    return e * (keep * (float)(y >= -87.0f));
}

/* The 32 weights e_i of word k (fewer in a last partial word) into e[], 0 where forbidden or below `cut`
 * (top-k / top-p; -inf: none); their float sum. */
static inline __attribute__((always_inline)) float word_weights(const void *x, int64_t n, int64_t k, const int half,
                                                                uint32_t allowed, float m, float inv_t, float cut,
                                                                float e[32]) {
    const int64_t base = 32 * k;
    if (n - base < 32) {
        float sum = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float v = j < n - base ? value(x, base + j, half) : -INFINITY;
            e[j] = j < n - base && ((allowed >> j) & 1) && v >= cut ? exp_nonpositive((v - m) * inv_t, 1.0f) : 0.0f;
            sum += e[j];
        }
        return sum;
    }
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), lo = _mm256_set1_ps(-87.0f);
    const __m256 vcut = _mm256_set1_ps(cut);
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256 acc = _mm256_setzero_ps();
    for (int q = 0; q < 4; q++) {
        const __m256 v = half ? bf16x8_to_float((const uint16_t *)x + base + 8 * q)
                              : _mm256_loadu_ps((const float *)x + base + 8 * q);
        const __m256 y = _mm256_mul_ps(_mm256_sub_ps(v, vm), vt);
        __m256 nn;
        const __m256 p = exp_reduced8(_mm256_max_ps(y, lo), &nn);
        const __m256i expo = _mm256_add_epi32(_mm256_cvtps_epi32(nn), _mm256_set1_epi32(127));
        const __m256 w = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(expo, 23)));
        const __m256i bits = _mm256_set1_epi32((int)((allowed >> (8 * q)) & 0xff));
        const __m256 keep = _mm256_and_ps(
            _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bits, lane), lane)),
                          _mm256_cmp_ps(y, lo, _CMP_GE_OQ)),
            _mm256_cmp_ps(v, vcut, _CMP_GE_OQ));
        const __m256 kept = _mm256_and_ps(w, keep);
        _mm256_storeu_ps(e + 8 * q, kept);
        acc = _mm256_add_ps(acc, kept);
    }
    return hsum8(acc);
#else
    float sum = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float v = value(x, base + j, half);
        e[j] = exp_nonpositive((v - m) * inv_t, (float)(((allowed >> j) & 1) && v >= cut));
        sum += e[j];
    }
    return sum;
#endif
}

/* The maximum of word k's allowed values (-inf if none); *nan set when one of them is a NaN */
static inline __attribute__((always_inline)) float word_max(const void *x, int64_t n, int64_t k, const int half,
                                                            uint32_t allowed, int *nan) {
    const int64_t base = 32 * k;
    const int len = n - base < 32 ? (int)(n - base) : 32;
    if (len < 32) {
        float wm = -INFINITY;
        for (int j = 0; j < len; j++) {
            const float v = ((allowed >> j) & 1) ? value(x, base + j, half) : -INFINITY;
            *nan |= v != v;
            wm = v > wm ? v : wm;
        }
        return wm;
    }
    float v[32], mx[8];
    int bad = 0;
    for (int j = 0; j < 32; j++) {
        const float t = value(x, base + j, half);
        v[j] = ((allowed >> j) & 1) ? t : -INFINITY;
    }
    for (int l = 0; l < 8; l++) mx[l] = v[l];
    for (int j0 = 8; j0 < 32; j0 += 8)
        for (int l = 0; l < 8; l++) mx[l] = v[j0 + l] > mx[l] ? v[j0 + l] : mx[l];
    for (int j = 0; j < 32; j++) bad |= v[j] != v[j];
    *nan |= bad;
    float wm = mx[0];
    for (int l = 1; l < 8; l++) wm = mx[l] > wm ? mx[l] : wm;
    return wm;
}

/* Scratch for one call, sized for its widest row and largest top-k */
typedef struct {
    double *word_sums; /* a row's mass per word of 32 tokens */
    float *heap;       /* top-k: a min-heap of the k largest allowed values */
    double *buckets;   /* top-p: mass per bucket of (m - x) / T */
    float *vals;       /* top-p: the crossing bucket's (value, weight) pairs */
} Scratch;

#define TOP_P_BUCKETS 1024 /* over (m - x) / T in [0, 87): ~0.085 wide, a factor 1.09 in weight */

static inline uint32_t allowed_word(const int32_t *words, int64_t k) { /* word k's bits; all ones: no mask */
    return words ? (uint32_t)words[k] : 0xffffffffu;
}

static void sift_down(float *h, int k, int i) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= k) return;
        if (c + 1 < k && h[c + 1] < h[c]) c++;
        if (h[i] <= h[c]) return;
        const float t = h[i];
        h[i] = h[c];
        h[c] = t;
        i = c;
    }
}

/* The k-th largest allowed value of a row (ties counted: keeping every value >= it keeps at least k tokens,
 * as torch's topk threshold does); -inf when fewer than k tokens are allowed. */
static float top_k_cut(const void *x, int64_t n, const int half, const int32_t *words, int k, float *heap) {
    int size = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!((allowed_word(words, i >> 5) >> (i & 31)) & 1)) continue;
        const float v = value(x, i, half);
        if (size < k) {
            int j = size++;
            heap[j] = v;
            while (j > 0 && heap[(j - 1) / 2] > heap[j]) { /* sift up */
                const float t = heap[j];
                heap[j] = heap[(j - 1) / 2];
                heap[(j - 1) / 2] = t;
                j = (j - 1) / 2;
            }
        } else if (v > heap[0]) {
            heap[0] = v;
            sift_down(heap, k, 0);
        }
    }
    return size < k ? -INFINITY : heap[0];
}

static int by_value_desc(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* One pass over the tokens >= `cut` with a weight: with `collect` < 0 their weights are summed per bucket of
 * (m - x) / T into sc->buckets (returns 0, the total in *z); else the (value, weight) pairs of bucket
 * `collect` go to sc->vals (returns their count). */
static int64_t bin_pass(const void *x, int64_t n, const int half, const int32_t *words, float m, float inv_t,
                        float cut, int collect, Scratch *sc, double *z) {
    const int64_t nw = (n + 31) / 32;
    const float scale = TOP_P_BUCKETS / 87.0f;
    float e[32];
    int64_t count = 0;
    for (int64_t k = 0; k < nw; k++) {
        const uint32_t allowed = allowed_word(words, k);
        if (!allowed) continue;
        word_weights(x, n, k, half, allowed, m, inv_t, cut, e);
        for (int j = 0; j < 32; j++) {
            if (e[j] <= 0.0f) continue;
            const float v = value(x, 32 * k + j, half);
            int b = (int)((m - v) * inv_t * scale);
            b = b < TOP_P_BUCKETS ? b : TOP_P_BUCKETS - 1;
            if (collect < 0) {
                sc->buckets[b] += e[j];
                *z += e[j];
            } else if (b == collect) {
                sc->vals[2 * count] = v;
                sc->vals[2 * count + 1] = e[j];
                count++;
            }
        }
    }
    return count;
}

/* top-p over the tokens >= `cut` (top-k's): the logit of the last token kept, the tokens in descending
 * order, kept while the mass before them is <= p of the total (the first always). The weights are binned by
 * (m - x) / T; every bucket before the one where the running mass passes p Z is kept whole; that bucket's
 * tokens are sorted by value and walked. Tokens with a weight of 0 (more than 87 T below the maximum) are
 * never reached before the mass passes p Z, unless p is 1 (then no cut at all). */
static float top_p_cut(const void *x, int64_t n, const int half, const int32_t *words, float m, float inv_t,
                       float cut, float p, Scratch *sc) {
    double z = 0.0;
    for (int b = 0; b < TOP_P_BUCKETS; b++) sc->buckets[b] = 0.0;
    bin_pass(x, n, half, words, m, inv_t, cut, -1, sc, &z);
    const double target = (double)p * z;
    double before = 0.0;
    int cross = TOP_P_BUCKETS - 1;
    for (int b = 0; b < TOP_P_BUCKETS; b++) {
        if (before + sc->buckets[b] > target) {
            cross = b;
            break;
        }
        before += sc->buckets[b];
    }
    const int64_t count = bin_pass(x, n, half, words, m, inv_t, cut, cross, sc, &z); /* the crossing bucket */
    if (count == 0) return cut; /* no mass at all past the buckets walked: keep what top-k kept */
    qsort(sc->vals, (size_t)count, 2 * sizeof(float), by_value_desc);
    float last = sc->vals[0];
    for (int64_t i = 0; i < count; i++) {
        if (before > target && i > 0) break;
        last = sc->vals[2 * i];
        before += sc->vals[2 * i + 1];
    }
    return last > cut ? last : cut;
}

static inline __attribute__((always_inline)) int64_t sample_row(const void *x, int64_t n, const int half,
                                                                float inv_t, double u, const int32_t *words,
                                                                int top_k, float top_p, Scratch *sc) {
    double *word_sums = sc->word_sums;
    const int64_t nw = (n + 31) / 32;
    float m = -INFINITY;
    for (int64_t k = 0; k < nw; k++) { /* pass 1: the maximum of the allowed tokens; a NaN returns at once */
        const uint32_t allowed = allowed_word(words, k);
        if (!allowed) continue;
        const int64_t base = 32 * k;
        const int len = n - base < 32 ? (int)(n - base) : 32;
        int nan = 0;
        const float wm = word_max(x, n, k, half, allowed, &nan);
        if (nan)
            for (int j = 0; j < len; j++)
                if (((allowed >> j) & 1) && value(x, base + j, half) != value(x, base + j, half)) return base + j;
        m = wm > m ? wm : m;
    }
    if (m == -INFINITY) return 0; /* nothing allowed (or every allowed logit -inf) */
    if (m == INFINITY) /* all the mass on the +inf logits: the first allowed one */
        for (int64_t i = 0; i < n; i++)
            if (((allowed_word(words, i >> 5) >> (i & 31)) & 1) && value(x, i, half) == INFINITY) return i;
    float cut = -INFINITY; /* keep the tokens >= cut: top-k's k-th value, then top-p's last kept one */
    if (top_k > 0 && top_k < n) cut = top_k_cut(x, n, half, words, top_k, sc->heap);
    if (top_p < 1.0f) cut = top_p_cut(x, n, half, words, m, inv_t, cut, top_p, sc);
    float e[32];
    double total = 0.0;
    for (int64_t k = 0; k < nw; k++) { /* pass 2: each word's mass, in double from here on */
        const uint32_t allowed = allowed_word(words, k);
        word_sums[k] = allowed ? (double)word_weights(x, n, k, half, allowed, m, inv_t, cut, e) : 0.0;
        total += word_sums[k];
    }
    const double target = u * total;
    double run = 0.0;
    int64_t last = -1; /* the last word with any mass: where a target rounded up to the total lands */
    for (int64_t k = 0; k < nw; k++) { /* pass 3: the word, then the token */
        if (word_sums[k] <= 0.0) continue;
        last = k;
        if (run + word_sums[k] <= target) {
            run += word_sums[k];
            continue;
        }
        const uint32_t allowed = allowed_word(words, k);
        word_weights(x, n, k, half, allowed, m, inv_t, cut, e);
        int tail = -1;
        for (int j = 0; j < 32; j++) {
            if (e[j] <= 0.0f) continue;
            tail = j;
            run += e[j];
            if (run > target) return 32 * k + j;
        }
        return 32 * k + tail; /* the word's float sum rounded above its values' double sum: its last token */
    }
    word_weights(x, n, last, half, allowed_word(words, last), m, inv_t, cut, e);
    for (int j = 31; j >= 0; j--)
        if (e[j] > 0.0f) return 32 * last + j;
    return 0; /* not reached: the maximum's weight is 1 */
}

typedef struct {
    const void *x;
    int64_t *out;
    int64_t n;
    int half, max_k, any_p;
    const float *inv_t, *top_p;
    const double *u;
    const int32_t *words, *top_k;
    volatile int rc; /* -1 once any run of rows ran out of memory */
} SampleJob;

/* rows [r0, r1) of a job, with scratch of its own (runs of rows may run on the pool's threads at once) */
static void sample_run(void *ctx, int64_t r0, int64_t r1) {
    SampleJob *j = (SampleJob *)ctx;
    const int64_t n = j->n, nw = (n + 31) / 32, row_bytes = n * (j->half ? 2 : 4);
    Scratch sc = {malloc(sizeof(double) * (size_t)nw), j->max_k ? malloc(sizeof(float) * (size_t)j->max_k) : NULL,
                  j->any_p ? malloc(sizeof(double) * TOP_P_BUCKETS) : NULL,
                  j->any_p ? malloc(2 * sizeof(float) * (size_t)n) : NULL};
    if (!sc.word_sums || (j->max_k && !sc.heap) || (j->any_p && (!sc.buckets || !sc.vals))) {
        j->rc = -1;
    } else {
        for (int64_t r = r0; r < r1; r++) {
            const void *row = (const char *)j->x + r * row_bytes;
            const int32_t *w = j->words ? j->words + r * nw : NULL;
            const int k = j->top_k ? j->top_k[r] : 0;
            const float p = j->top_p ? j->top_p[r] : 1.0f;
            j->out[r] = j->half ? sample_row(row, n, 1, j->inv_t[r], j->u[r], w, k, p, &sc)
                                : sample_row(row, n, 0, j->inv_t[r], j->u[r], w, k, p, &sc);
        }
    }
    free(sc.word_sums);
    free(sc.heap);
    free(sc.buckets);
    free(sc.vals);
}

/* x: rows x n float32 (half 0) or bfloat16 (half 1) logits; inv_t: 1 / temperature per row; u: a uniform in
 * [0, 1) per row; words: NULL, or rows x ceil(n / 32) grammar mask words; top_k (0: off) and top_p (1: off):
 * NULL, or one per row. Rows are shared out over the helper pool (pool.h's `pool_rows`, `threads` and `linger`
 * as the other row kernels take them); a row's draw is the same whoever runs it. Returns 0, or -1 when out of
 * memory. */
int sample_rows(const void *x, int64_t *out, int rows, int64_t n, int half, const float *inv_t, const double *u,
                const int32_t *words, const int32_t *top_k, const float *top_p, int threads, int linger) {
    int max_k = 0, any_p = 0;
    for (int r = 0; r < rows; r++) {
        if (top_k && top_k[r] > max_k && top_k[r] < n) max_k = top_k[r];
        any_p |= top_p && top_p[r] < 1.0f;
    }
    SampleJob job = {x, out, n, half, max_k, any_p, inv_t, top_p, u, words, top_k, 0};
    /* a row costs ~3 passes with an exp per value: weigh it as three rows of plain values */
    pool_rows(sample_run, &job, rows, 3 * n, threads, linger);
    return job.rc;
}
