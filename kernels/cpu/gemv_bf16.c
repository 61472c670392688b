/* y[M, N] (float32) = x[M, K] . w[N, K]^T for bfloat16 x and w and a few rows M: the decode GEMV of
 * bfloat16 linear layers on CPUs with AVX512-BF16. Built and loaded by kernels/cpu_gemv.py.
 *
 * At M = 1 a GEMV reads every weight once and does one multiply-add per weight, so it should run at
 * the memory's read rate; torch's bfloat16 GEMM converts to float32 and reached about half of it
 * (7 GB/s on one core where a float32 sum reads 12-16). Here `vdpbf16ps` multiplies 32 bfloat16 pairs
 * and adds them, in pairs, into 16 float32 sums per instruction, straight from the loaded weights: the
 * products are exact (8-bit by 8-bit mantissas) and the sums float32, like torch's bfloat16 GEMM up to
 * summation order (and the pairwise grouping of the instruction). Four weight rows are read side by
 * side, each x row loaded once per 32 columns for all four; the K tail is a masked load (zeros).
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

static void rows(const Args *a) {
    const int K = a->K, full = K & ~31;
    const __mmask32 tail = (__mmask32)((1ull << (K - full)) - 1);
    for (int n = a->n0; n < a->n1; n += 4) {
        const int nr = a->n1 - n < 4 ? a->n1 - n : 4;
        const uint16_t *w0 = a->w + (int64_t)n * K;
        for (int m = 0; m < a->M; m++) {
            const uint16_t *xm = a->x + (int64_t)m * K;
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
            __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
            if (nr == 4) {
                for (int k = 0; k < full; k += 32) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + k);
                    acc0 = _mm512_dpbf16_ps(acc0, xv, (__m512bh)_mm512_loadu_si512(w0 + k));
                    acc1 = _mm512_dpbf16_ps(acc1, xv, (__m512bh)_mm512_loadu_si512(w0 + K + k));
                    acc2 = _mm512_dpbf16_ps(acc2, xv, (__m512bh)_mm512_loadu_si512(w0 + 2 * (int64_t)K + k));
                    acc3 = _mm512_dpbf16_ps(acc3, xv, (__m512bh)_mm512_loadu_si512(w0 + 3 * (int64_t)K + k));
                }
                if (tail) {
                    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, xm + full);
                    acc0 = _mm512_dpbf16_ps(acc0, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + full));
                    acc1 = _mm512_dpbf16_ps(acc1, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + K + full));
                    acc2 = _mm512_dpbf16_ps(acc2, xv,
                                            (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + 2 * (int64_t)K + full));
                    acc3 = _mm512_dpbf16_ps(acc3, xv,
                                            (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + 3 * (int64_t)K + full));
                }
                float *ym = a->y + (int64_t)m * a->N + n;
                ym[0] = _mm512_reduce_add_ps(acc0);
                ym[1] = _mm512_reduce_add_ps(acc1);
                ym[2] = _mm512_reduce_add_ps(acc2);
                ym[3] = _mm512_reduce_add_ps(acc3);
            } else { /* the last 1-3 rows */
                for (int r = 0; r < nr; r++) {
                    const uint16_t *wr = w0 + (int64_t)r * K;
                    __m512 acc = _mm512_setzero_ps();
                    for (int k = 0; k < full; k += 32)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(xm + k),
                                               (__m512bh)_mm512_loadu_si512(wr + k));
                    if (tail)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, xm + full),
                                               (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + full));
                    a->y[(int64_t)m * a->N + n + r] = _mm512_reduce_add_ps(acc);
                }
            }
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
