/* gemv_bf16.c's compute on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake,
 * most laptops): the same y[M, N] = x[M, K] . w[N, K]^T for bfloat16 x and w, in float32 FMAs on 8 lanes.
 * Included by gemv_bf16.c, which keeps the pool and the entry point; results are rounded to bfloat16 by
 * bits.h's float_to_bf16 (to nearest, ties to even), as in the AVX-512 per-row code.
 *
 * Numerics: the products of bfloat16 values are exact in float32 (8-bit by 8-bit mantissas) and the sums are
 * float32, as in the vdpbf16ps and FMA tiles of gemv_bf16.c and torch's bfloat16 GEMM; only the summation
 * order differs.
 *
 * x is widened once per call into `xf` (every call here; the entry point's `fma` flag has no other meaning on
 * these CPUs), each 16-column block stored as its 8 even columns then its 8 odd ones. A 16-value weight block
 * (one 256-bit load, read as 8 pairs) then becomes float32 in one instruction per half: the even columns are
 * the low halves shifted up 16 bits, the odd ones the high halves with the low bits cleared. Columns past K are
 * zeros in xf and in the weights' tail block (copied into a zeroed buffer).
 *
 * Up to CHUNK x rows: one weight row at a time in memory order (one long stream for the prefetchers), two
 * accumulators per x row (even and odd columns: two chains in flight per row, 2 M + 2 + 1 of the 16 ymm
 * registers at M = 6). More rows: tiles of NR = 2 weight rows by MR = 4 x rows (8 accumulators, both rows'
 * widened halves and one x row's two vectors: 14 registers and the mask), so each x vector is loaded once for
 * two weight rows (10 loads per 16 FMAs; 3 x 4 tiles with x from memory per FMA, 28 per 24, ran 40-47 GFLOP/s
 * on two cores where float32 MKL ran 79); weight blocks of FNB rows kept in L2 while every x tile passes over
 * them; the first x tile prefetches the next 2 weight rows. "Loaded once" needs saying to gcc: it had folded each
 * x vector into both of its FMAs as a memory operand (18 loads per 16 FMAs, bound by the two load ports), so the
 * tile pins it in a register. On a 2-core AMD EPYC VM (Zen 3 flags), `edgeserve bench cpu-kernels --sections
 * linear` (SmolLM2's 121 linears, 2 threads), two alternating runs, ms before / after: 8 rows 24.2 / 23.3 ->
 * 22.5 / 21.9, 16 rows 41.0 / 40.4 -> 38.4 / 37.7, 32 rows 77.7 / 74.3 -> 68.0 / 67.2, 128 rows 283 / 280 ->
 * 251 / 250 (0.89-0.94x the time).
 */
#include <immintrin.h>

#define XF_COLS(K) (((K) + 15) & ~15) /* xf's row stride: K rounded up to whole 16-column blocks */
#define WIDEN_ALWAYS 1                /* the entry point widens x for every call */

static void widen_x(const uint16_t *x, float *xf, int M, int K) {
    const int K16 = XF_COLS(K);
    for (int m = 0; m < M; m++) {
        const uint16_t *xr = x + (int64_t)m * K;
        float *out = xf + (int64_t)m * K16;
        for (int k = 0; k < K16; k += 16)
            for (int i = 0; i < 8; i++) {
                out[k + i] = k + 2 * i < K ? bf16_to_float(xr[k + 2 * i]) : 0.0f;
                out[k + 8 + i] = k + 2 * i + 1 < K ? bf16_to_float(xr[k + 2 * i + 1]) : 0.0f;
            }
    }
}

/* The weights' last K % 16 columns, zero-padded to one block (the caller's buffer). */
static inline __m256i tail_block(const uint16_t *wr, int full16, int K, uint16_t buf[16]) {
    for (int i = 0; i < 16; i++) buf[i] = full16 + i < K ? wr[full16 + i] : 0;
    return _mm256_loadu_si256((const __m256i *)buf);
}

/* PF_DIST (gemv_bf16.c) weights ahead of the loads are prefetched into L2, as in the AVX-512 copy. */
static inline __attribute__((always_inline)) void rows_m(const Args *a, const int M) {
    const int K = a->K, K16 = XF_COLS(K), full16 = K & ~15;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    uint16_t buf[16];
    for (int n = a->n0; n < a->n1; n++) {
        const uint16_t *wr = a->w + (int64_t)n * K;
        __m256 ae[CHUNK], ao[CHUNK];
        for (int m = 0; m < M; m++) {
            ae[m] = _mm256_setzero_ps();
            ao[m] = _mm256_setzero_ps();
        }
        for (int k = 0; k < K16; k += 16) {
            if ((k & 31) == 0) _mm_prefetch((const char *)(wr + k + PF_DIST), _MM_HINT_T1); /* one line per 32 */
            const __m256i v = k < full16 ? _mm256_loadu_si256((const __m256i *)(wr + k)) : tail_block(wr, k, K, buf);
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            for (int m = 0; m < M; m++) {
                const float *xr = a->xf + (int64_t)m * K16 + k;
                ae[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), we, ae[m]);
                ao[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), wo, ao[m]);
            }
        }
        for (int m = 0; m < M; m++) a->y[(int64_t)m * a->N + n] = float_to_bf16(hsum8(_mm256_add_ps(ae[m], ao[m])));
    }
}

#define NR 2
#define MR 4
#define FNB 64

/* rows n, n+1 of w with x rows m0..m0+rows-1 (rows <= MR, a compile-time constant per copy) */
static inline __attribute__((always_inline)) void ftile(const Args *a, int n, int m0, const int rows,
                                                        const uint16_t *prefetch) {
    const int K = a->K, K16 = XF_COLS(K), full16 = K & ~15;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    const uint16_t *w0 = a->w + (int64_t)n * K, *w1 = w0 + K;
    const float *x = a->xf + (int64_t)m0 * K16;
    uint16_t buf[16];
    __m256 acc[MR][NR];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = _mm256_setzero_ps();
    for (int k = 0; k < K16; k += 16) {
        if (prefetch && (k & 31) == 0) /* the next 2 weight rows, one line of each per 32 columns */
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(prefetch + (int64_t)j * K + k), _MM_HINT_T1);
        const __m256i v0 = k < full16 ? _mm256_loadu_si256((const __m256i *)(w0 + k)) : tail_block(w0, k, K, buf);
        const __m256i v1 = k < full16 ? _mm256_loadu_si256((const __m256i *)(w1 + k)) : tail_block(w1, k, K, buf);
        const __m256 we0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 wo0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
        const __m256 we1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        const __m256 wo1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
        for (int m = 0; m < rows; m++) { /* each x vector loaded once, used for both weight rows */
            const float *xr = x + (int64_t)m * K16 + k;
            __m256 xe = _mm256_loadu_ps(xr), xo = _mm256_loadu_ps(xr + 8);
            __asm__("" : "+x"(xe), "+x"(xo)); /* loaded once, in registers: not folded into each FMA as a load */
            acc[m][0] = _mm256_fmadd_ps(xo, wo0, _mm256_fmadd_ps(xe, we0, acc[m][0]));
            acc[m][1] = _mm256_fmadd_ps(xo, wo1, _mm256_fmadd_ps(xe, we1, acc[m][1]));
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NR; j++) a->y[(int64_t)(m0 + m) * a->N + n + j] = float_to_bf16(hsum8(acc[m][j]));
}
