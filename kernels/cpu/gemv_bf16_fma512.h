/* gemv_bf16.c's float32-FMA tiles on 16 lanes, shared by its AVX512-BF16 copy (where they race the vdpbf16ps tiles)
 * and gemv_bf16_avx512f.h (AVX-512F without BF16, where they are the only tiles). The includer defines NR, MR (the
 * tile: NR weight rows by at most MR x rows), PF_DIST and store_tile (the 4 x 4 sums rounded to bfloat16 into y).
 *
 * Float32 FMAs, for cores where `vdpbf16ps` is the slower way to multiply (the Emerald Rapids Xeon VM of
 * gemv_bf16.c's vdpbf16ps tiles: 75 against 123 GFLOP/s a core) or that have none. x is widened once per call
 * into `xf`; each 32-column block of it is stored as its 16 even columns then its 16 odd ones, so a weight block
 * of 32 bfloat16 values (one 512-bit load, read as 16 pairs) becomes float32 with one instruction per half: the
 * even columns are the low halves shifted up 16 bits, the odd ones the high halves with the low bits cleared.
 * Products and sums are float32 as with `vdpbf16ps` (whose pairwise grouping differs): the same
 * exact products, summed in another order. The loops run weight blocks of FNB rows (in L2) by x tiles
 * of 4 rows (4 * K32 floats, in L1) by 4 weight rows: x is read from L1, each weight vector once per
 * x tile from L2. One core: 101-112 GFLOP/s at 8-32 rows over SmolLM2's shapes, the vdpbf16ps tiles
 * 66-71 (same harness, same host). Where both build, `cpu_gemv.tile_mode` picks one per process by timing both. */
#define FNB 64

static void widen_x(const uint16_t *x, float *xf, int M, int K) {
    const int K32 = (K + 31) & ~31;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K32; k += 32) {
            const int left = K - k;
            const __mmask32 mk = left >= 32 ? 0xffffffffu : (__mmask32)((1ull << left) - 1);
            const __m512i v = _mm512_maskz_loadu_epi16(mk, x + (int64_t)m * K + k); /* zeros past K */
            _mm512_storeu_ps(xf + (int64_t)m * K32 + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_storeu_ps(xf + (int64_t)m * K32 + k + 16, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
        }
}

static inline __attribute__((always_inline)) void ftile(const Args *a, int n, int m0, const int rows,
                                                        const uint16_t *prefetch) {
    const int K = a->K, K32 = (K + 31) & ~31, full32 = K & ~31;
    const __mmask32 tail = (__mmask32)((1ull << (K - full32)) - 1);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    const uint16_t *w = a->w + (int64_t)n * K;
    const float *x = a->xf + (int64_t)m0 * K32;
    __m512 acc[MR][NR];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < K32; k += 32) {
        if (prefetch) /* the next 4 weight rows, one line of each per 32 columns */
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(prefetch + (int64_t)j * K + k), _MM_HINT_T1);
        __m512 we[NR], wo[NR];
        for (int j = 0; j < NR; j++) {
            const __m512i v = k < full32 ? _mm512_loadu_si512(w + (int64_t)j * K + k)
                                         : _mm512_maskz_loadu_epi16(tail, w + (int64_t)j * K + k);
            we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int m = 0; m < rows; m++) {
            const float *xr = x + (int64_t)m * K32 + k;
            const __m512 xe = _mm512_loadu_ps(xr), xo = _mm512_loadu_ps(xr + 16);
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_fmadd_ps(xo, wo[j], _mm512_fmadd_ps(xe, we[j], acc[m][j]));
        }
    }
    store_tile(a, acc, n, m0, rows);
}
