/* Float bit helpers the CPU kernels share (a header: each kernel is its own shared object). kernels/cpu_build.py
 * keys every build by the headers here too, so a change to this file rebuilds the kernels. */
#ifndef EDGESERVE_BITS_H
#define EDGESERVE_BITS_H
#include <stdint.h>
#include <string.h>

static inline float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* 2^e exactly, for e in [-128, 127] (int8 exponents): normal for e >= -126, the two subnormals below it. */
static inline float pow2i(int e) {
    return e >= -126 ? bits_to_float((uint32_t)(e + 127) << 23) : bits_to_float(0x00800000u >> (-126 - e));
}

/* bfloat16 -> float32: exact (the 16 bits on top). */
static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

/* float32 -> bfloat16: to nearest, ties to even, as torch rounds; NaN stays NaN (quiet, its sign kept). */
static inline uint16_t float_to_bf16(float f) {
    const uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif
