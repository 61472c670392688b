/* gemv_bf16.c's compute on CPUs with AVX-512F but no AVX512-BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake):
 * the same y[M, N] = x[M, K] . w[N, K]^T for bfloat16 x and w, in float32 FMAs on 16 lanes. Included by
 * gemv_bf16.c, which keeps the pool and the entry point; results are rounded to bfloat16 by bits.h's
 * float_to_bf16 (to nearest, ties to even), as in the other copies.
 *
 * Numerics: the products of bfloat16 values are exact in float32 and the sums are float32, as in the other
 * copies and torch's bfloat16 GEMM; only the summation order differs.
 *
 * x is widened once per call into `xf` (every call: WIDEN_ALWAYS), in the FMA tiles' layout (gemv_bf16_fma512.h:
 * each 32-column block as its 16 even columns then its 16 odd ones), so a 32-value weight block (one 512-bit load)
 * becomes float32 in one instruction per half. Up to CHUNK x rows: one weight row at a time in memory order, two
 * accumulators per x row (even and odd columns). More rows: the FMA tiles of gemv_bf16_fma512.h (4 weight rows by
 * up to 4 x rows), the same code the AVX512-BF16 copy races against its vdpbf16ps tiles.
 *
 * These CPUs took the AVX2 copy (8 lanes) before. On a 2-core Intel Xeon VM (Ice Lake-SP by its flags: AVX-512F,
 * VNNI, VBMI, no BF16 or AMX), SmolLM2's 121 linears (30 layers' own weights, streamed, and the LM head), 2 threads,
 * both copies built side by side (the AVX2 one with -mno-avx512f), best of 5 alternating passes, ms AVX2 -> this
 * copy: 1 row 12.0 -> 11.7, 8 rows 20.5 -> 17.9, 32 rows 66.0 -> 50.6 (130 -> 170 GFLOP/s), 128 rows 249 -> 182.
 * Other tiles on the same host changed little (32 / 128 rows, ms): 6 x rows by 3 weight rows 50.3 / 178.5, 5 by 4
 * 50.5 / 177.1, 8 by 2 50.9 / 191.0, against these 4 by 4 51.7 / 184.9: the widening (2 of the port-0/5 ops per
 * weight vector, against 2 MR FMAs) is not what bounds them.
 */
#include <immintrin.h>

#define XF_COLS(K) (((K) + 31) & ~31) /* xf's row stride: K rounded up to whole 32-column blocks */
#define WIDEN_ALWAYS 1                /* the entry point widens x for every call */

/* PF_DIST (gemv_bf16.c) weights ahead of the loads are prefetched into L2, one line (32 values) a step. */
static inline __attribute__((always_inline)) void rows_m(const Args *a, const int M) {
    const int K = a->K, K32 = XF_COLS(K), full32 = K & ~31;
    const __mmask32 tail = (__mmask32)((1ull << (K - full32)) - 1);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    for (int n = a->n0; n < a->n1; n++) {
        const uint16_t *wr = a->w + (int64_t)n * K;
        __m512 ae[CHUNK], ao[CHUNK]; /* M <= CHUNK: 12 accumulators and the two widened halves in registers */
        for (int m = 0; m < M; m++) {
            ae[m] = _mm512_setzero_ps();
            ao[m] = _mm512_setzero_ps();
        }
        for (int k = 0; k < K32; k += 32) {
            _mm_prefetch((const char *)(wr + k + PF_DIST), _MM_HINT_T1); /* past the end: harmless */
            const __m512i v = k < full32 ? _mm512_loadu_si512(wr + k) : _mm512_maskz_loadu_epi16(tail, wr + k);
            const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            for (int m = 0; m < M; m++) {
                const float *xr = a->xf + (int64_t)m * K32 + k;
                ae[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), we, ae[m]);
                ao[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), wo, ao[m]);
            }
        }
        for (int m = 0; m < M; m++)
            a->y[(int64_t)m * a->N + n] = float_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(ae[m], ao[m])));
    }
}

#define NR 4
#define MR 4

/* y[m0 + m, n..n+3] = the sums of acc[m][0..3], rounded to bfloat16 one by one (no vcvtneps2bf16 here) */
static inline __attribute__((always_inline)) void store_tile(const Args *a, __m512 acc[MR][NR], int n, int m0,
                                                             const int rows) {
    for (int m = 0; m < rows; m++) {
        float s[4];
        _mm_storeu_ps(s, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        uint16_t *y = a->y + (int64_t)(m0 + m) * a->N + n;
        for (int j = 0; j < 4; j++) y[j] = float_to_bf16(s[j]);
    }
}

#include "gemv_bf16_fma512.h" /* widen_x and ftile */
