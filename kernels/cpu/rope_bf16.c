/* Rotary position embedding of bfloat16 heads in one pass: for x [T, H, D] (rows `row_stride` elements apart,
 * heads D apart) and per-token rotations f [T, P] (complex float32: cos and sin times the attention factor),
 * y [T, H, D] (contiguous) holds each head's pairs (x[2i], x[2i + 1]), i < P, rotated by f[t, i] and its dims
 * past 2P copied. Built and loaded by kernels/cpu_rope.py.
 *
 * Arithmetic as backend/rope.py's torch path (x widened exactly, a complex float32 product, rounded to
 * bfloat16 to nearest, ties to even): re = a c - b d, im = a d + b c, one of the two products of each fused
 * into a multiply-add (AVX-512: 8 pairs a step with `vfmaddsub`; the scalar tail likewise where the compiler
 * contracts), where torch's vectorised complex product may round both: a result can differ from torch's by
 * an ulp of float32, which changes the bfloat16 result only where it sits on a rounding boundary.
 * One pass where torch makes three (widen a strided view, multiply, narrow): measured on a 2-core AMD EPYC VM,
 * one thread, SmolLM2's 12 query and key heads of 64, the Python call included: 29 -> 10 us a call at 32
 * tokens (torch's took 0.9 ms of a c = 32 decode step over 30 layers), 118 -> 43 at 256.
 *
 * `rope_f32` is the same rotation of float32 heads into float32 (no rounding past the complex product's), for
 * the float32 decode layers (decode_layers.c).
 */
#include <stdint.h>

#include "bits.h"
#include "pool.h"

typedef struct {
    const uint16_t *x;
    const float *f;
    uint16_t *y;
    int heads, dim, pairs;
    int64_t row_stride;
} Job;

static void rope_rows(void *ctx, int64_t r0, int64_t r1) {
    const Job *j = (const Job *)ctx;
    const uint16_t *x = j->x;
    const float *f = j->f;
    uint16_t *y = j->y;
    const int heads = j->heads, dim = j->dim, pairs = j->pairs;
    const int64_t row_stride = j->row_stride;
    for (int64_t t = r0; t < r1; t++) {
        const float *ft = f + (int64_t)t * pairs * 2;
        for (int h = 0; h < heads; h++) {
            const uint16_t *xh = x + (int64_t)t * row_stride + (int64_t)h * dim;
            uint16_t *yh = y + ((int64_t)t * heads + h) * dim;
            int i = 0;
#ifdef __AVX512F__
            for (; i + 8 <= pairs; i += 8) { /* 8 pairs: lanes a0 b0 a1 b1 ..., rotations c0 d0 c1 d1 ... */
                const __m512 v = bf16x16_to_float(xh + 2 * i), fr = _mm512_loadu_ps(ft + 2 * i);
                const __m512 c = _mm512_moveldup_ps(fr), d = _mm512_movehdup_ps(fr);
                const __m512 swapped = _mm512_permute_ps(v, 0xB1); /* b0 a0 b1 a1 ... */
                /* even lanes a c - b d, odd lanes b c + a d */
                store_bf16x16(yh + 2 * i, _mm512_fmaddsub_ps(v, c, _mm512_mul_ps(swapped, d)));
            }
#endif
            for (; i < pairs; i++) {
                const float a = bf16_to_float(xh[2 * i]), b = bf16_to_float(xh[2 * i + 1]);
                const float c = ft[2 * i], d = ft[2 * i + 1];
                yh[2 * i] = float_to_bf16(a * c - b * d);
                yh[2 * i + 1] = float_to_bf16(a * d + b * c);
            }
            for (i = 2 * pairs; i < dim; i++) yh[i] = xh[i];
        }
    }
}

typedef struct {
    const float *x;
    const float *f;
    float *y;
    int heads, dim, pairs;
    int64_t row_stride;
} JobF32;

static void rope_rows_f32(void *ctx, int64_t r0, int64_t r1) {
    const JobF32 *j = (const JobF32 *)ctx;
    const int heads = j->heads, dim = j->dim, pairs = j->pairs;
    for (int64_t t = r0; t < r1; t++) {
        const float *ft = j->f + (int64_t)t * pairs * 2;
        for (int h = 0; h < heads; h++) {
            const float *xh = j->x + (int64_t)t * j->row_stride + (int64_t)h * dim;
            float *yh = j->y + ((int64_t)t * heads + h) * dim;
            int i = 0;
#ifdef __AVX512F__
            for (; i + 8 <= pairs; i += 8) { /* as rope_rows */
                const __m512 v = _mm512_loadu_ps(xh + 2 * i), fr = _mm512_loadu_ps(ft + 2 * i);
                const __m512 c = _mm512_moveldup_ps(fr), d = _mm512_movehdup_ps(fr);
                const __m512 swapped = _mm512_permute_ps(v, 0xB1);
                _mm512_storeu_ps(yh + 2 * i, _mm512_fmaddsub_ps(v, c, _mm512_mul_ps(swapped, d)));
            }
#endif
            for (; i < pairs; i++) {
                const float a = xh[2 * i], b = xh[2 * i + 1], c = ft[2 * i], d = ft[2 * i + 1];
                yh[2 * i] = a * c - b * d;
                yh[2 * i + 1] = a * d + b * c;
            }
            for (i = 2 * pairs; i < dim; i++) yh[i] = xh[i];
        }
    }
}

/* Rows on the shared pool (pool.h's `pool_rows`) where the call is large enough. */
void rope_f32(const float *x, const float *f, float *y, int rows, int heads, int dim, int pairs, int64_t row_stride,
              int threads, int linger) {
    JobF32 job = {x, f, y, heads, dim, pairs, row_stride};
    pool_rows(rope_rows_f32, &job, rows, (int64_t)heads * dim, threads, linger);
}

/* Rows on the shared pool (pool.h's `pool_rows`) where the call is large enough. */
void rope_bf16(const uint16_t *x, const float *f, uint16_t *y, int rows, int heads, int dim, int pairs,
               int64_t row_stride, int threads, int linger) {
    Job job = {x, f, y, heads, dim, pairs, row_stride};
    pool_rows(rope_rows, &job, rows, (int64_t)heads * dim, threads, linger);
}
