/* gemv_f32.c's compute on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel client cores): the same
 * y[M, N] = x[M, K] . w[N, K]^T for float32 x and w, in FMAs on 8 lanes. Included by gemv_f32.c, which keeps
 * the pool, the tile loops and the entry point. Numerics as there: float32 products and sums, another order.
 *
 * Up to CHUNK x rows: one weight row at a time in memory order, two accumulators per x row (two chains in
 * flight per row: 2 M + 2 of the 16 ymm registers at M = 6), prefetching PF_DIST ahead. More rows: tiles of
 * NR = 2 weight rows by MR = 6 x rows (12 accumulators, 2 weight vectors and one x vector: 15 registers; 8 loads
 * per 12 FMAs). The K tail (K % 8 columns) is a masked load (`vmaskmovps`: zeros, nothing read past K).
 *
 * On a 2-core AMD EPYC VM (Zen 3 flags), SmolLM2's 121 linears at 2 threads (`edgeserve bench cpu-kernels
 * --sections linear_f32`), 6 x 2 tiles against the 4 x 2 ones before (8 accumulators, 6 loads per 8 FMAs), two
 * runs each alternating: 8 rows 30.8 against 36.7 ms, 16 rows 48.2 / 55.2, 32 rows 78.8 / 86.4, 64 rows
 * 141 / 159 (1.10-1.19x); 135 GFLOP/s at 96-128 rows, ~70% of the cores' FMA peak.
 *
 * From WIDE_ROWS rows two more things (the same VM kind, 2026-12-05): gcc had folded each x load into both of
 * its FMAs (14 loads per 12 FMAs: bound by the two load ports, not the FMAs), so a full tile now keeps its x
 * vector in a register; and K past KBLK runs in blocks (the first stores, the others add), since an x tile's 6
 * rows of a 1,536-column down projection (36 KB) overflowed L1 and every x load went to L2 (bound by L2's 32
 * bytes a cycle). One thread, SmolLM2's four shapes, weights from memory: 64 -> 70 GFLOP/s at 32 rows, 72 -> 82
 * at 128 (the down projection 60 -> 66 and 67 -> 77); fewer rows than WIDE_ROWS lost 3-10% to either change, so
 * they keep the old code. Two threads, the 121 linears, two alternating runs: 32 rows 76.6 / 76.2 -> 73.9 /
 * 69.7 ms, 128 rows 263 / 265 -> 242 / 240, 8 and 16 rows unchanged. Tried and dropped: splitting the last full
 * tile with one or two rows left (`last_rows`), the tile's sums by `hadd` pairs (no change), FNB 32 or 128 (no
 * change), prefetching the next block across all x tiles instead of the next rows in the first (0.75-0.96x).
 */
#include <immintrin.h>

#define CHUNK 6
#define NR 2
#define MR 6
#define FNB 64
#define WIDE_ROWS 12 /* rows from which a call's full tiles keep x in registers (`ftile`) and K runs in blocks */
#define KBLK 768     /* columns of a block of K: an x tile's 6 rows of it, 18 KB, stay in L1 with the weight lines */

/* The first `left` (0..8) lanes set: the mask of the K tail's `vmaskmovps` */
static inline __m256i tail_mask(int left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) void rows_m(const Args *a, const int M) {
    const int K = a->K, full = K & ~15, full8 = K & ~7;
    const __m256i tail = tail_mask(K - full8);
    const float *x = a->x;
    for (int n = a->n0; n < a->n1; n++) {
        const float *wr = a->w + (int64_t)n * K;
        __m256 a0[CHUNK], a1[CHUNK];
        for (int m = 0; m < M; m++) {
            a0[m] = _mm256_setzero_ps();
            a1[m] = _mm256_setzero_ps();
        }
        int k = 0;
        for (; k < full; k += 16) {
            _mm_prefetch((const char *)(wr + k + PF_DIST), _MM_HINT_T1); /* one line per 16 floats */
            const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
            for (int m = 0; m < M; m++) {
                a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (int64_t)m * K + k), w0, a0[m]);
                a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (int64_t)m * K + k + 8), w1, a1[m]);
            }
        }
        if (k < full8) { /* one 8-column step left */
            const __m256 w0 = _mm256_loadu_ps(wr + k);
            for (int m = 0; m < M; m++) a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (int64_t)m * K + k), w0, a0[m]);
        }
        if (K > full8) { /* the last K % 8 columns, masked */
            const __m256 w0 = _mm256_maskload_ps(wr + full8, tail);
            for (int m = 0; m < M; m++)
                a1[m] = _mm256_fmadd_ps(_mm256_maskload_ps(x + (int64_t)m * K + full8, tail), w0, a1[m]);
        }
        for (int m = 0; m < M; m++) a->y[(int64_t)m * a->N + n] = hsum8(_mm256_add_ps(a0[m], a1[m]));
    }
}

/* rows n, n+1 of w with x rows m0..m0+rows-1 (rows <= MR, a compile-time constant per copy); `prefetch`: the
 * next weight rows to bring into L2 (one line of each per 16 columns), or NULL; `valid`: as gemv_f32.c's (a
 * missing row n+1 repeats row n, unstored) */
static inline __attribute__((always_inline)) void ftile_x(const Args *a, int n, int m0, const int rows,
                                                          const float *prefetch, const int valid, const int xreg) {
    const int K = a->K, ld = a->ld, full8 = K & ~7;
    const __m256i tail = tail_mask(K - full8);
    const float *w0 = a->w + (int64_t)n * ld, *w1 = valid > 1 ? w0 + ld : w0, *x = a->x + (int64_t)m0 * ld;
    __m256 acc[MR][NR];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = _mm256_setzero_ps();
    for (int k = 0; k < full8; k += 8) {
        if (prefetch && (k & 15) == 0)
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(prefetch + (int64_t)j * ld + k), _MM_HINT_T1);
        const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
        for (int m = 0; m < rows; m++) { /* each x vector loaded once, used for both weight rows */
            __m256 xv = _mm256_loadu_ps(x + (int64_t)m * ld + k);
            if (xreg) __asm__("" : "+x"(xv)); /* one load, in a register (`ftile`) */
            acc[m][0] = _mm256_fmadd_ps(xv, v0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, v1, acc[m][1]);
        }
    }
    if (K > full8) { /* the last K % 8 columns, masked */
        const __m256 v0 = _mm256_maskload_ps(w0 + full8, tail), v1 = _mm256_maskload_ps(w1 + full8, tail);
        for (int m = 0; m < rows; m++) {
            const __m256 xv = _mm256_maskload_ps(x + (int64_t)m * ld + full8, tail);
            acc[m][0] = _mm256_fmadd_ps(xv, v0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, v1, acc[m][1]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < valid; j++) {
            float *yr = a->y + (int64_t)(m0 + m) * a->N + n + j;
            *yr = a->add ? *yr + hsum8(acc[m][j]) : hsum8(acc[m][j]);
        }
}

/* A full tile of a call of WIDE_ROWS rows or more loads each x vector once into a register; gcc otherwise folds
 * it into both FMAs as a memory operand (15 of the 16 registers are taken), 14 loads per 12 FMAs where the two
 * load ports pass 12 in the FMAs' 6 cycles. With fewer rows the tiles wait on the weights from memory more than
 * on loads, and the folded form (fewer instructions a step, so more steps' weight loads in flight) is faster. */
static inline __attribute__((always_inline)) void ftile(const Args *a, int n, int m0, const int rows,
                                                        const float *prefetch, const int valid) {
    if (rows == MR && a->M >= WIDE_ROWS)
        ftile_x(a, n, m0, rows, prefetch, valid, 1);
    else
        ftile_x(a, n, m0, rows, prefetch, valid, 0);
}
