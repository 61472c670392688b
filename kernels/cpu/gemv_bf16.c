/* y[M, N] (float32) = x[M, K] . w[N, K]^T for bfloat16 x and w and a few rows M: the decode GEMV of
 * bfloat16 linear layers on CPUs with AVX512-BF16. Built and loaded by kernels/cpu_gemv.py.
 *
 * At M = 1 a GEMV reads every weight once and does one multiply-add per weight, so it should run at
 * the memory's read rate; torch's bfloat16 GEMM converts to float32 and reached about half of it
 * (7 GB/s on one core where a float32 sum reads 12-16). Here `vdpbf16ps` multiplies 32 bfloat16 pairs
 * and adds them, in pairs, into 16 float32 sums per instruction, straight from the loaded weights: the
 * products are exact (8-bit by 8-bit mantissas) and the sums float32, like torch's bfloat16 GEMM up to
 * summation order (and the pairwise grouping of the instruction). Weight rows are read one after the
 * other (`rows_m`); the K tail is a masked load (zeros).
 *
 * Threads: the N rows are split into `threads` contiguous ranges (multiples of 4 rows), one pthread
 * each besides the caller; the caller decides when a call is large enough to pay for starting them.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>

#ifndef __AVX512BF16__
#error "needs AVX512-BF16 (this CPU does not have it: torch's GEMM runs instead)"
#endif

typedef struct {
    const uint16_t *x, *w;
    float *y;
    int M, N, K, n0, n1;
} Args;

#define CHUNK 6 /* x rows per pass over the weights (cpu_gemv.MAX_ROWS: past it Linear keeps torch's GEMM) */

/* One weight row at a time, in memory order: the hardware prefetchers see one long stream (four
 * rows read side by side were four short ones, and ran at half the rate: 9.9 against 18.5 GB/s on one
 * core over SmolLM2's linears). Each 32-column weight vector is loaded once and multiplied with every
 * x row (from L1); two accumulators per x row (even and odd 32-column steps) keep two chains in flight.
 * `M` is a compile-time constant in each specialisation, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_m(const Args *a, const int M) {
    const int K = a->K, full = K & ~63, full32 = K & ~31;
    const __mmask32 tail = (__mmask32)((1ull << (K - full32)) - 1);
    const uint16_t *x = a->x;
    for (int n = a->n0; n < a->n1; n++) {
        const uint16_t *wr = a->w + (int64_t)n * K;
        __m512 a0[CHUNK], a1[CHUNK]; /* M <= CHUNK: 12 accumulators and 2 weight vectors in registers */
        for (int m = 0; m < M; m++) {
            a0[m] = _mm512_setzero_ps();
            a1[m] = _mm512_setzero_ps();
        }
        int k = 0;
        for (; k < full; k += 64) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
            for (int m = 0; m < M; m++) {
                a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k), w0);
                a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k + 32), w1);
            }
        }
        if (k < full32) { /* one 32-column step left */
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
            for (int m = 0; m < M; m++)
                a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k), w0);
        }
        if (tail) { /* the last K % 32 columns, masked (zeros past K) */
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + full32);
            for (int m = 0; m < M; m++)
                a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + (int64_t)m * K + full32),
                                         w0);
        }
        for (int m = 0; m < M; m++)
            a->y[(int64_t)m * a->N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
    }
}

static void rows(const Args *a) { /* x rows in chunks of at most CHUNK, each chunk a specialisation */
    for (int m0 = 0; m0 < a->M; m0 += CHUNK) {
        Args b = *a;
        b.x = a->x + (int64_t)m0 * a->K;
        b.y = a->y + (int64_t)m0 * a->N;
        b.M = a->M - m0 < CHUNK ? a->M - m0 : CHUNK;
        switch (b.M) {
        case 1: rows_m(&b, 1); break;
        case 2: rows_m(&b, 2); break;
        case 3: rows_m(&b, 3); break;
        case 4: rows_m(&b, 4); break;
        case 5: rows_m(&b, 5); break;
        default: rows_m(&b, 6); break;
        }
    }
}

static void *run(void *p) {
    rows((const Args *)p);
    return NULL;
}

void gemv_bf16(const uint16_t *x, const uint16_t *w, float *y, int M, int N, int K, int threads) {
    if (threads < 1) threads = 1;
    if (threads > 16) threads = 16;
    const int blocks = (N + 3) / 4;
    if (threads > blocks) threads = blocks;
    Args args[16];
    pthread_t tid[16];
    for (int i = 0; i < threads; i++) {
        const int b0 = blocks * i / threads, b1 = blocks * (i + 1) / threads;
        const int n1 = 4 * b1 < N ? 4 * b1 : N;
        args[i] = (Args){x, w, y, M, N, K, 4 * b0, n1};
    }
    int started = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tid[i], NULL, run, &args[i]) != 0) break;
        started = i;
    }
    for (int i = started + 1; i < threads; i++) rows(&args[i]); /* threads that could not start */
    rows(&args[0]);
    for (int i = 1; i <= started; i++) pthread_join(tid[i], NULL);
}
