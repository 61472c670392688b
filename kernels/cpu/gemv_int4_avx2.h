/* gemv_int4.c's compute on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake):
 * the same y[M, N] = x[M, K] . W[N, K]^T for bfloat16 x and an INT4 group-wise W, on the same packed layout,
 * in float32 FMAs on 8 lanes. Included by gemv_int4.c, which keeps the layout, the row blocks, the pool and the
 * entry point.
 *
 * Numerics as the AVX-512 copy: a code q becomes 128 + q (its 4 bits under the bits of 128.0, here the float32
 * 0x430q0000), each product (128 + q) x is exact in float32 (8-bit by 8-bit mantissas), the sums are float32,
 * and per group sum_k W[n, k] x[k] = s D + (z - 136 s) X. Only the summation order differs.
 *
 * x is widened once per call into float32 (`xf`, [M, K]) beside its group sums `xs`, so each x value is one
 * broadcast load. A panel's 64 bytes for 8 columns are two 256-bit halves, rows 0-7 and rows 8-15: 32-bit lane
 * i of a half holds row i's columns 8t + 2j (nibble j of its low word) and 8t + 2j + 1 (of its high word). Per
 * column pair j, the words shifted down 4 j bits (16-bit shifts), masked to their low nibble and OR-ed with
 * 0x4300 hold both columns at once: shifted up 16 bits the lane is column 2j's 128 + q, with its low word
 * cleared column 2j + 1's. 18 integer instructions per half and 8 columns (64 products), where AVX-512 needs 7
 * for 256; each broadcast x value serves both halves (16 output rows).
 *
 * Tiles: up to MAXR x rows by one panel, NA chains of D per row and half: 2 at 1-2 rows (4 and 8 chains in
 * flight; 4 per half at one row ran 1.07x the time), 1 at 3-4 rows (6 and 8; two FMA units of 4-cycle latency
 * need 8). The running sums are kept in memory between groups, once per group, so the registers hold the
 * chains; each group's s D + (z - 136 s) X is formed before it joins them (gemv_int4.c's header: 1.02x the
 * time of adding the two terms one by one, which let the running sum carry 136 s X).
 *
 * Measured on a 2-core AMD EPYC VM (Zen 3 by its flags, no AVX-512) over SmolLM2's 30 layers' linears at g = 32
 * streamed from memory, 2 threads, ms (this kernel / torch's `_weight_int4pack_mm_for_cpu` / the bfloat16
 * GEMV's AVX2 copy on 4x the bytes), one run: 1 row 8.1 / 11.8 / 13.0; 2: 8.1 / 11.4 / 13.4; 4: 11.2 / 20.6 /
 * 16.6; 8: 18.5 / 26.9 / 23.2; 32: 74.5 / 116.4 / 77.5 (the machine's noise moves such runs by 10-25%; the
 * ratios held). In cache (one 3072 x 576 weight, one thread, 1 row) a 64-byte block took ~8 ns, ~20 cycles for
 * its ~62 instructions: compute-bound at one row, where the bfloat16 GEMV is bound by memory. Tried and
 * dropped, same machine, the two builds alternating in one process, one thread: x broadcast into memory once
 * per call (FMAs with a memory operand instead of a broadcast per value: 0.96x the time at 1-2 rows, 1.03x at
 * 4); prefetching 4 KB ahead instead of 2 (1.05x); into L1 (within noise); tiles of at most 2 rows (1.35x at
 * 4-32 rows); 3-4 row tiles over one half of a panel at a time with 2 chains each (1.17x at 4-32 rows: it
 * would have made a row's bits independent of the other rows of the call, which this copy, like the AVX-512
 * one, does not promise). In isolation a layout decoded by byte unpacks (`vpunpcklbw` with 0x43 bytes) ran
 * 0.95x this inner loop's time: not worth a second packing.
 */
#include <immintrin.h>

#define MAXR 4   /* x rows per tile */
#define WIDEN 1  /* the entry point widens x to float32 (xf) */

/* xs[m, g] = sum of x[m] over group g's columns, and xf = x in float32 */
static void prepare_x(const uint16_t *x, float *xs, float *xf, int M, int K, int G, int group) {
    for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = bf16_to_float(x[i]);
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const float *xr = xf + (int64_t)m * K;
            const int k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
            __m256 s = _mm256_setzero_ps();
            int k = k0;
            for (; k + 8 <= k1; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + k));
            float t = hsum8(s);
            for (; k < k1; k++) t += xr[k];
            xs[(int64_t)m * G + g] = t;
        }
}

/* x rows m0..m0+MR-1 by panel p (compile-time MR and NA in each copy) */
static inline __attribute__((always_inline)) void tile(const Args *a, int p, int m0, const int MR, const int NA,
                                                       const int prefetch) {
    const int K = a->K, G = a->G;
    const __m256i nib = _mm256_set1_epi16(0x000f), one28 = _mm256_set1_epi16(0x4300);
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    const __m256 c136 = _mm256_set1_ps(136.0f);
    const uint8_t *panel = a->q + (int64_t)p * K * 8;
    float acc[MAXR][PANEL] __attribute__((aligned(32))); /* the running sums, updated once per group */
    for (int m = 0; m < MR; m++)
        for (int i = 0; i < PANEL; i++) acc[m][i] = 0.0f;
    for (int g = 0; g < G; g++) {
        const int k0 = g * a->group, k1 = k0 + a->group < K ? k0 + a->group : K;
        __m256 d[MAXR][2][2]; /* the group's sums of (128 + q) x: per row, half and chain (NA <= 2) */
        for (int m = 0; m < MR; m++)
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < NA; i++) d[m][h][i] = _mm256_setzero_ps();
        for (int k = k0; k < k1; k += 8) {
            const uint8_t *qp = panel + (int64_t)k * 8;
            if (prefetch) _mm_prefetch((const char *)qp + PF_DIST, _MM_HINT_T1);
            const __m256i v[2] = {_mm256_loadu_si256((const __m256i *)qp),
                                  _mm256_loadu_si256((const __m256i *)(qp + 32))};
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256 we[2], wo[2];
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    __m256i u = j ? _mm256_srli_epi16(v[h], 4 * j) : v[h];
                    u = _mm256_or_si256(j < 3 ? _mm256_and_si256(u, nib) : u, one28);
                    we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); /* column k + 2j */
                    wo[h] = _mm256_castsi256_ps(_mm256_and_si256(u, high)); /* column k + 2j + 1 */
                }
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++) {
                    const float *xm = a->xf + (int64_t)(m0 + m) * K + k + 2 * j;
                    const __m256 xe = _mm256_broadcast_ss(xm), xo = _mm256_broadcast_ss(xm + 1);
                    const int c = (2 * j) % NA, c1 = (2 * j + 1) % NA;
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        d[m][h][c] = _mm256_fmadd_ps(we[h], xe, d[m][h][c]);
                        d[m][h][c1] = _mm256_fmadd_ps(wo[h], xo, d[m][h][c1]);
                    }
                }
            }
        }
        const uint16_t *sz = a->sz + ((int64_t)p * G + g) * 2 * PANEL;
        for (int h = 0; h < 2; h++) {
            const __m256 s = bf16x8_to_float(sz + 8 * h), z = bf16x8_to_float(sz + PANEL + 8 * h);
            const __m256 zs = _mm256_fnmadd_ps(c136, s, z); /* z - 136 s */
            for (int m = 0; m < MR; m++) { /* the group's own sum first: acc never holds the 136 s X terms */
                __m256 dm = d[m][h][0];
                for (int i = 1; i < NA; i++) dm = _mm256_add_ps(dm, d[m][h][i]);
                const __m256 x = _mm256_broadcast_ss(a->xs + (int64_t)(m0 + m) * G + g);
                const __m256 t = _mm256_fmadd_ps(dm, s, _mm256_mul_ps(x, zs));
                _mm256_store_ps(acc[m] + 8 * h, _mm256_add_ps(_mm256_load_ps(acc[m] + 8 * h), t));
            }
        }
    }
    const int n = p * PANEL, left = a->N - n < PANEL ? a->N - n : PANEL;
    for (int m = 0; m < MR; m++)
        for (int i = 0; i < left; i++) a->y[(int64_t)(m0 + m) * a->N + n + i] = float_to_bf16(acc[m][i]);
}

/* x rows m0..m0+rows-1 (rows <= MAXR) over panels p0..p1: one specialisation per count */
static void run_rows(const Args *a, int m0, int rows, int prefetch) {
    for (int p = a->p0; p < a->p1; p++) switch (rows) {
        case 1: tile(a, p, m0, 1, 2, prefetch); break;
        case 2: tile(a, p, m0, 2, 2, prefetch); break;
        case 3: tile(a, p, m0, 3, 1, prefetch); break;
        default: tile(a, p, m0, 4, 1, prefetch); break;
        }
}
