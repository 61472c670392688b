/* gemv_int4.c's compute on CPUs with AVX-512F but no AVX512-BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake): the
 * same y[M, N] = x[M, K] . W[N, K]^T for bfloat16 x and an INT4 group-wise W, on the same packed layout, in
 * float32 FMAs on 16 lanes: gemv_int4_avx2.h's computation with a whole panel (16 output rows) in one register.
 * Included by gemv_int4.c, which keeps the layout, the row blocks, the pool and the entry point.
 *
 * Numerics as the other copies: a code q becomes 128 + q (the float32 0x430q0000), each product (128 + q) x is exact
 * in float32, the sums are float32, and per group sum_k W[n, k] x[k] = s D + (z - 136 s) X, the group's two terms
 * formed before they join the running sum. Only the summation order differs.
 *
 * x is widened once per call into float32 (`xf`, [M, K]) beside its group sums `xs`; each x value is a broadcast
 * operand of its FMA. A panel's 64 bytes for 8 columns are one register: 32-bit lane i holds row i's columns
 * 8t + 2j (nibble j of its low word) and 8t + 2j + 1 (of its high word). Per column pair j, the words shifted down
 * 4 j bits, masked to their low nibble and OR-ed with 0x4300 (one `vpternlogd`) hold both columns: shifted up 16
 * bits the lane is column 2j's 128 + q, with its low word cleared column 2j + 1's. 4 integer instructions per pair
 * (3 for j = 0), 15 per 64 bytes, against the AVX2 copy's 36 for the same 128 products' decoding.
 *
 * Tiles: up to MAXR = 8 x rows by one panel, NA chains of D per row: 4 at 1-2 rows, 2 past that (two FMA units
 * of 4-cycle latency need 8 in flight).
 *
 * These CPUs took the AVX2 copy before. On a 2-core Intel Xeon VM (Ice Lake-SP by its flags), SmolLM2's 30 layers'
 * linears at g = 32 streamed from memory, both copies built side by side (the AVX2 one with -mno-avx512f), best
 * of 5 alternating passes, ms AVX2 -> this copy: 1 row 8.46 -> 6.65, 4 rows 15.1 -> 13.0, 8 rows 26.8 -> 21.4,
 * 32 rows 82.6 -> 64.6. A whole c = 32 INT4 decode step (`edgeserve bench token-profile --decode-weights int4
 * --concurrency 32`) 86.3 -> 70.6 ms, c = 1 7.8 ms.
 */
#include <immintrin.h>

#define MAXR 8  /* x rows per tile */
#define WIDEN 1 /* the entry point widens x to float32 (xf) */

/* xs[m, g] = sum of x[m] over group g's columns, and xf = x in float32 */
static void prepare_x(const uint16_t *x, float *xs, float *xf, int M, int K, int G, int group) {
    const int64_t total = (int64_t)M * K;
    int64_t i = 0;
    for (; i + 16 <= total; i += 16) _mm512_storeu_ps(xf + i, bf16x16_to_float(x + i));
    for (; i < total; i++) xf[i] = bf16_to_float(x[i]);
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const float *xr = xf + (int64_t)m * K;
            const int k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
            __m512 s = _mm512_setzero_ps();
            int k = k0;
            for (; k + 16 <= k1; k += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(xr + k));
            float t = _mm512_reduce_add_ps(s);
            for (; k < k1; k++) t += xr[k];
            xs[(int64_t)m * G + g] = t;
        }
}

/* x rows m0..m0+MR-1 by panel p (compile-time MR and NA in each copy) */
static inline __attribute__((always_inline)) void tile(const Args *a, int p, int m0, const int MR, const int NA,
                                                       const int prefetch) {
    const int K = a->K, G = a->G;
    const __m512i nib = _mm512_set1_epi16(0x000f), one28 = _mm512_set1_epi16(0x4300);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    const uint8_t *panel = a->q + (int64_t)p * K * 8;
    const float *x = a->xf + (int64_t)m0 * K;
    __m512 acc[MAXR];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const int k0 = g * a->group, k1 = k0 + a->group < K ? k0 + a->group : K;
        __m512 d[MAXR][4]; /* the group's sums of (128 + q) x: NA chains per row */
        for (int m = 0; m < MR; m++)
            for (int i = 0; i < NA; i++) d[m][i] = _mm512_setzero_ps();
        for (int k = k0; k < k1; k += 8) {
            const uint8_t *qp = panel + (int64_t)k * 8;
            if (prefetch) _mm_prefetch((const char *)qp + PF_DIST, _MM_HINT_T1);
            const __m512i v = _mm512_loadu_si512(qp);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512i u = _mm512_ternarylogic_epi32(j ? _mm512_srli_epi16(v, 4 * j) : v, nib, one28, 0xEA);
                const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)); /* column k + 2j */
                const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(u, high)); /* column k + 2j + 1 */
                const int c = (2 * j) % NA, c1 = (2 * j + 1) % NA;
#pragma GCC unroll 8
                for (int m = 0; m < MR; m++) {
                    const float *xm = x + (int64_t)m * K + k + 2 * j;
                    d[m][c] = _mm512_fmadd_ps(we, _mm512_set1_ps(xm[0]), d[m][c]);
                    d[m][c1] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xm[1]), d[m][c1]);
                }
            }
        }
        add_group(a, p, g, m0, MR, NA, d, acc); /* gemv_int4.c's */
    }
    const int n = p * PANEL, left = a->N - n;
    const __mmask16 keep = left >= PANEL ? 0xffff : (__mmask16)((1u << left) - 1);
    for (int m = 0; m < MR; m++)
        _mm512_mask_cvtepi32_storeu_epi16(a->y + (int64_t)(m0 + m) * a->N + n, keep, round_bf16(acc[m]));
}
