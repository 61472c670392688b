/* Quantise-and-store of new tokens' K and V into an FP8 (e4m3fn) paged KV cache, on the CPU, in one
 * pass: the same bytes as kernels/kv_store.py's `store_kv_ref` (its format and numerics are defined
 * there), without its ~20 small torch ops per layer. Built and loaded by kernels/cpu_kv_store.py.
 *
 * Layouts:
 *   k, v        [T, KVH, HD] float32 or bf16 (`bf16`), rows of HD contiguous, strides in elements
 *   kc, vc      [NSLOTS, KVH, HD] e4m3fn bytes (the pool's pages flattened: slot = page * S + offset)
 *   ks, vs      [NSLOTS, KVH] int8 exponents: value = fp8 * 2^e
 *   slots       [T] int64
 *
 * Per (token, KV head): amax = max |x| over HD in float32 (NaN if any element is NaN, as torch's
 * amax); e = ceil(log2(amax / 448)) clamped to [-64, 63], read exactly from amax's bits; each
 * element x * 2^-e (one exact float32 multiply by a power of two, as torch.ldexp), clamped to
 * +-448, rounded to e4m3 to nearest, ties to even (subnormals below 2^-6 in steps of 2^-9; NaN
 * stays NaN, 0x7f with its sign). A non-finite amax gets the exponent torch's frexp path gives it
 * (inf: -8, NaN: -9), so even a broken model's cache holds the same bytes on both paths.
 * Returns 0, or -1 (nothing written) when a slot is outside [0, NSLOTS). A prompt chunk's tokens are shared out
 * as pool.h's `run_chunks` says (`store_kv_fp8_threaded`).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bits.h"
#include "pool.h"

#define MAX_HD 1024

/* ceil(log2(amax / 448)) clamped to [-64, 63], from amax's bits: amax = 1.m * 2^p and 448 = 1.75 * 2^8,
 * so e = p - 8 + (1.m > 1.75); zero and float32 subnormals clamp to -64. */
static inline int fp8_exponent(uint32_t amax) {
    uint32_t field = amax >> 23, mant = amax & 0x7FFFFF;
    if (field == 0xFF)
        return mant ? -9 : -8; /* NaN, inf: what frexp's (mantissa, 0) gives the reference */
    int e = (int)field - 127 - 8 + (mant > 0x600000);
    return e < -64 ? -64 : e > 63 ? 63 : e;
}

/* float32 (|x| <= 448, or NaN) -> e4m3fn bits, round to nearest even; branch-free so the loop vectorises. */
static inline uint8_t to_e4m3(float x) {
    uint32_t b = float_to_bits(x);
    uint32_t sign = (b >> 24) & 0x80;
    uint32_t a = b & 0x7FFFFFFF;
    /* below 2^-6: e4m3 subnormals, multiples of 2^-9 (8 * 2^-9 is the smallest normal); 0 stands in
     * for other values so the conversion never sees a NaN */
    uint32_t sub = (uint32_t)(int32_t)rintf(bits_to_float(a < 0x3C800000 ? a : 0) * 512.0f);
    uint32_t r = a + 0x7FFFF + ((a >> 20) & 1); /* round the 23 mantissa bits to 3, ties to even */
    uint32_t normal = (r >> 20) - ((127 - 7) << 3);
    return (uint8_t)(sign | (a > 0x7F800000 ? 0x7F : a < 0x3C800000 ? sub : normal));
}

/* One (token, KV head) row of HD values: its exponent and its e4m3 bytes. */
static void store_row(const void *x, int64_t at, int HD, int bf16, uint8_t *out, int8_t *exponent) {
    uint32_t bits[MAX_HD];
    if (bf16) {
        const uint16_t *p = (const uint16_t *)x + at;
        for (int d = 0; d < HD; d++)
            bits[d] = (uint32_t)p[d] << 16;
    } else {
        memcpy(bits, (const float *)x + at, (size_t)HD * 4);
    }
    /* |x| as integers orders as the floats do, and any NaN's bits exceed inf's: one integer max
     * gives amax, or says it is NaN (torch's amax propagates NaN) */
    uint32_t amax = 0;
    for (int d = 0; d < HD; d++) {
        uint32_t a = bits[d] & 0x7FFFFFFF;
        amax = a > amax ? a : amax;
    }
    int e = fp8_exponent(amax);
    float s = pow2i(-e); /* 2^-e, exactly: -e in [-63, 64] */
    for (int d = 0; d < HD; d++) {
        float q = bits_to_float(bits[d]) * s;
        q = q > 448.0f ? 448.0f : q < -448.0f ? -448.0f : q; /* NaN passes through */
        out[d] = to_e4m3(q);
    }
    *exponent = (int8_t)e;
}

typedef struct {
    const void *k, *v;
    int64_t k_stride_t, k_stride_h, v_stride_t, v_stride_h;
    uint8_t *kc, *vc;
    int8_t *ks, *vs;
    const int64_t *slots;
    int KVH, HD, bf16;
} Store;

/* Tokens [t0, t1) of a store: each (token, KV head) row of K and V into its slot. */
static void store_tokens(void *ctx, int64_t t0, int64_t t1) {
    const Store *a = (const Store *)ctx;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t slot = a->slots[t];
        for (int h = 0; h < a->KVH; h++) {
            const int64_t row = slot * a->KVH + h;
            store_row(a->k, t * a->k_stride_t + h * a->k_stride_h, a->HD, a->bf16, a->kc + row * a->HD, a->ks + row);
            store_row(a->v, t * a->v_stride_t + h * a->v_stride_h, a->HD, a->bf16, a->vc + row * a->HD, a->vs + row);
        }
    }
}

/* The store of T tokens, its tokens shared out (pool.h's `pool_rows`: contiguous runs, a row's bytes as on
 * one thread; `linger` the `how` of `run_chunks`) where the call is large enough (a prompt chunk's), else on
 * the caller. The slots of one call are distinct (each token has its own). Returns 0, or -1 (nothing written)
 * when a slot is outside [0, NSLOTS). */
int store_kv_fp8_threaded(const void *k, const void *v, int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                          int64_t v_stride_h, uint8_t *kc, uint8_t *vc, int8_t *ks, int8_t *vs, const int64_t *slots,
                          int T, int KVH, int HD, int64_t nslots, int bf16, int threads, int linger) {
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= nslots)
            return -1;
    Store job = {k, v, k_stride_t, k_stride_h, v_stride_t, v_stride_h, kc, vc, ks, vs, slots, KVH, HD, bf16};
    pool_rows(store_tokens, &job, T, 2 * (int64_t)KVH * HD, threads, linger);
    return 0;
}

/* store_kv_fp8_threaded on the caller alone (the fused decode layers' entry: a decode step's few tokens). */
int store_kv_fp8(const void *k, const void *v, int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                 int64_t v_stride_h, uint8_t *kc, uint8_t *vc, int8_t *ks, int8_t *vs, const int64_t *slots,
                 int T, int KVH, int HD, int64_t nslots, int bf16) {
    return store_kv_fp8_threaded(k, v, k_stride_t, k_stride_h, v_stride_t, v_stride_h, kc, vc, ks, vs, slots, T, KVH,
                                 HD, nslots, bf16, 1, 0);
}
