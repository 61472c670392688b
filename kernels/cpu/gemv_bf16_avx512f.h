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
 * weight vector, against 2 MR FMAs) is not what bounds them. What did bound them in part was the tiles' last
 * step, 16 sums rounded to bfloat16 in scalar code; rounded as one vector (`store_tile`, the same bits), the same
 * 121 linears on the same kind of host took 0.92x the time at 7 and 8 rows, 0.88x at 16 and 30, 0.77-0.89x at 32
 * (medians of 7-9 alternating passes, two runs). Widening each block of weights once into float32 (in L2) for
 * all x tiles instead of per x tile took 1.07-1.10x the time at 32 rows and 1.4x at 8: the store pass costs more
 * than the shifts it saves.
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

/* y[m0 + m, n..n+3] = the sums of acc[m][0..3], rounded to bfloat16 together: each row's 4 sums (`sum4`) are one
 * 128-bit lane of a vector that `round_bf16` rounds at once, and each row is stored as 64 bits. Rounding the 16
 * sums one by one in scalar code (`float_to_bf16`) cost ~100 integer ops a tile, ~12% of a 4 x 4 tile's time at
 * K = 576; the results are the same bits. */
static inline __attribute__((always_inline)) void store_tile(const Args *a, __m512 acc[MR][NR], int n, int m0,
                                                             const int rows) {
    __m512 s = _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) /* rows is a constant here: the inserts unroll */
        switch (m) {
        case 0: s = _mm512_castps128_ps512(sum4(acc[0][0], acc[0][1], acc[0][2], acc[0][3])); break;
        case 1: s = _mm512_insertf32x4(s, sum4(acc[1][0], acc[1][1], acc[1][2], acc[1][3]), 1); break;
        case 2: s = _mm512_insertf32x4(s, sum4(acc[2][0], acc[2][1], acc[2][2], acc[2][3]), 2); break;
        default: s = _mm512_insertf32x4(s, sum4(acc[3][0], acc[3][1], acc[3][2], acc[3][3]), 3); break;
        }
    const __m256i h = _mm512_cvtepi32_epi16(round_bf16(s)); /* rows 0 and 1 in the low 128 bits, 2 and 3 high */
    const __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
    uint16_t *y = a->y + (int64_t)m0 * a->N + n;
    _mm_storel_epi64((__m128i *)y, lo);
    if (rows > 1) _mm_storel_epi64((__m128i *)(y + a->N), _mm_unpackhi_epi64(lo, lo));
    if (rows > 2) _mm_storel_epi64((__m128i *)(y + 2 * (int64_t)a->N), hi);
    if (rows > 3) _mm_storel_epi64((__m128i *)(y + 3 * (int64_t)a->N), _mm_unpackhi_epi64(hi, hi));
}

#include "gemv_bf16_fma512.h" /* widen_x and ftile */
