/* Paged decode attention on the CPU: one query token per sequence, keys and values read from the
 * page pool in place (fp32, bf16 or fp8_e4m3 with one power-of-two exponent per token and KV head),
 * dequantised one page row at a time into a buffer that stays in L1, with an online softmax.
 * No copy of the context is ever made. Built and loaded by kernels/cpu_paged_attention.py.
 *
 * Layouts (contiguous):
 *   q, out     [D, KVH, G, HD] float32   (the G query heads of KV head h are rows h*G .. h*G+G-1)
 *   k, v       [P, S, KVH, HD]           element type by `fmt`: 0 fp32, 1 bf16, 2 fp8_e4m3 (bytes)
 *   ke, ve     [P, S, KVH] int8          fp8 only: value = fp8 * 2^e
 *   table      [D, MAXP] int64           page ids in token order
 *   lens       [D] int32                 keys each sequence attends to (>= 1)
 *
 * fp8 -> fp32 without a table: e4m3 bits s eeee mmm placed as fp32 bits s 0000eeee mmm0... read as
 * 2^(e-127) (1 + m/8) for e > 0; the true values are 2^(e-7) (1 + m/8): off by exactly 2^120, which is
 * folded into the row's scale with the token's own 2^e (applied as two exact multiplies: 2^120 * 2^e
 * may not fit one float). The vector copies place the bits in float16 instead (off by 2^8; F16C's
 * conversion is exact), and the scalar code takes e = 0, 2^-6 (m/8), as m 2^-9: no float32 subnormal
 * is ever an operand (below). bf16 -> fp32 is the 16-bit shift. Sums are over HD in float32 (the
 * compiler may reassociate them to vectorise: the order of a 64-term sum, not the result's precision,
 * changes).
 *
 * Two copies of the loop: `attend_hd`, plain C the compiler vectorises (any head size, any CPU), and
 * `attend_vec` with AVX-512 intrinsics for head sizes 64 and 128 where the CPU has AVX-512, or the AVX2 copies
 * where the CPU has AVX2 and FMA but no AVX-512 (rows converted to float32 for every format; decode rows take
 * `attend_dec8`, which reads a row's KV heads together, each key row converted once in registers; prompt tiles
 * `attend_vec8`, a tile's query heads along the vector lanes, products as outer products). On AVX-512F CPUs
 * decode rows take `attend_dec16`, attend_dec8's scheme on 16 lanes, and prompt tiles
 * `attend_vec16`, attend_vec8's; bf16 q is widened exactly (`load_q`). CPUs with AVX512-BF16 had copies of
 * attend_vec that scored each query head by `vdpbf16ps` until 2026-12-07: on a Zen 4 VM attend_dec16 and
 * attend_vec16 took 0.64x (fp8 pages) and 0.91x (bf16) of their time for 32 decode rows of 2,000 keys and
 * 0.55-0.7x for prompt tiles (`attend_vec_dec`'s comment). Since then their prompt tiles with bf16 q over bf16 or
 * fp8 pages take `attend_pairs16`: attend_vec16's tile with both products by `vdpbf16ps` and the weights rounded
 * to bfloat16 (0.61x attend_vec16's time; paged_decode_pairs.h). Decode rows on AMX tiles score by `tdpbf16ps`.
 * Queries come in tiles: one row, or
 * consecutive rows of one prompt chunk (same pages, one more key each) whose query heads run together
 * against each block of keys; a work item is a tile's KV heads (or one of them where tiles are few). Decode
 * rows over bf16 or fp8 pages with bf16 q run on AMX tiles where the CPU has them (`attend_amx`).
 * Threads: the process's shared helper pool (kernels/cpu/pool.c) over items.
 *
 * Files: this one holds the layouts, the plain C copy, the helpers the vector copies share and the entry points;
 * each CPU's copies are headers it includes in their place: paged_decode_avx512.h (AVX-512F: attend_vec,
 * attend_dec16, attend_vec16), paged_decode_pairs.h (AVX512-BF16: attend_pairs16), paged_decode_avx2.h (attend_dec8,
 * attend_vec8) and paged_decode_amx.h (attend_amx). Each opens with its scheme and its measurements.
 *
 * Subnormals: on Intel cores an operation whose operand or result is a float32 subnormal takes a
 * microcode assist (~100+ cycles) unless MXCSR's DAZ / FTZ say otherwise (they are left as the caller has them:
 * results keep float32's range). Over fp8 pages they came up twice: the fp8 subnormal codes read as float32
 * subnormals by the bits above (the vector copies now go by float16, the scalar code by m 2^-9), and softmax
 * weights near float32's smallest normal times the token's 2^e < 1 (the weights' floor is now e^-60,
 * `EXP_CUTOFF`). Measured on an Ice Lake-SP VM (AVX-512F, no BF16), one layer of SmolLM2's shapes over random
 * fp8 pages as `bench cpu-kernels` fills them, 2 threads, alternating with the build before: 100 prompt rows after
 * 2,000 keys 16.2-16.7 ms -> 3.8-4.5 (bf16 pages 3.7-4.6), with a third of the codes subnormal 25-27 -> 3.9-4.6;
 * 32 decode rows of 2,100 keys 7.2-7.6 -> 3.6-4.0; the outputs the same bits. SmolLM2's own pages in a c = 32
 * step at 1,000-token contexts gave them rarely: the step's attention 47-53 ms -> 43-51 (noise).
 */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VECTOR_COPY 1 /* paged_decode_avx512.h or paged_decode_avx2.h, included below */
#include <immintrin.h>
#else
#define VECTOR_COPY 0
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bits.h"
#include "pool.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) /* the fp8 -> bfloat16 conversions, bfloat16 dot products */
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

#define BLOCK 32 /* tokens per softmax block */
#define MAX_HD 256
#define MAX_G 32 /* query heads a tile holds at most: G x its rows */
#define DEC_Q 16 /* query heads a decode row's item holds (attend_dec8, attend_dec16): G <= DEC_Q, KV heads in groups */

typedef struct {
    const void *q; /* float32, or bfloat16 when `half` */
    const void *k, *v;
    const int8_t *ke, *ve;
    const int64_t *table;
    const int32_t *lens;
    const int32_t *tiles; /* [ntiles + 1] first row of each tile, then D; NULL: every row a tile of its own */
    void *out; /* q's type */
    int D, KVH, G, HD, S, MAXP, fmt, half, ntiles;
    float scale;
    int item_heads; /* KV heads a work item holds: KVH (one after the other on one thread), or 1 */
} Args;

/* Tile t: rows tile_first(t) .. tile_first(t + 1) - 1 */
static inline int tile_first(const Args *a, int t) { return a->tiles ? a->tiles[t] : t; }

/* The G query rows of (sequence d, KV head h) as float32: in place, or widened from bfloat16 into buf. */
static inline const float *load_q(const Args *a, int d, int h, float *buf) {
    const int64_t off = ((int64_t)d * a->KVH + h) * a->G * a->HD;
    if (!a->half) return (const float *)a->q + off;
    const uint16_t *src = (const uint16_t *)a->q + off;
    for (int i = 0; i < a->G * a->HD; i++) buf[i] = bf16_to_float(src[i]);
    return buf;
}

/* Output row g of (d, h): acc * inv, in q's type. */
static inline void store_out(const Args *a, int d, int h, int g, const float *acc, float inv) {
    const int64_t off = (((int64_t)d * a->KVH + h) * a->G + g) * a->HD;
    if (!a->half) {
        float *out = (float *)a->out + off;
        for (int i = 0; i < a->HD; i++) out[i] = acc[i] * inv;
    } else {
        uint16_t *out = (uint16_t *)a->out + off;
        for (int i = 0; i < a->HD; i++) out[i] = float_to_bf16(acc[i] * inv);
    }
}

/* The softmax weights' floor: e^x below e^EXP_CUTOFF is 0, as e^-60 < 1e-26 is against a running sum >= 1 (far
 * under the float32 rounding of any sum it joins). Not -87, where 2^n would leave float32's normal range: over fp8
 * pages each weight is multiplied by its token's 2^e and then by V's codes, and weights near e^-87 made those
 * products float32 subnormals, each a microcode assist of ~100+ cycles on Intel cores (the top of the file). From
 * e^-60 (2^-86.6), times 2^e and the smallest code (2^-9), they stay normal for every e >= -30. */
#define EXP_CUTOFF -60.0f

/* e^x for finite x <= 0 (`exp_reduced`, bits.h), for the softmax loops; 0 below EXP_CUTOFF. Within 2 ulp of expf. */
static inline float exp_nonpositive(float x) {
    float n;
    const float p = exp_reduced(x < EXP_CUTOFF ? EXP_CUTOFF : x, &n);
    const float scale = bits_to_float((uint32_t)((int32_t)n + 127) << 23);
    return x < EXP_CUTOFF ? 0.0f : p * scale;
}

/* The page rows of a sequence's tokens t0 .. t0+n-1 for KV head h (page by page: no division per token). */
static inline void block_rows(const int64_t *pages, int t0, int n, int S, int KVH, int h, int64_t *rows) {
    for (int j = 0, p = t0 / S, o = t0 % S; j < n; j++) {
        rows[j] = (pages[p] * S + o) * KVH + h;
        if (++o == S) {
            o = 0;
            p++;
        }
    }
}

/* One block of the online softmax for one query head, its running max m, sum l and output acc: with the
 * block's max bm (>= m), rescale what came before by e^(m - bm) and turn the block's scores s into weights. */
static inline __attribute__((always_inline)) void softmax_step(float *s, int n, float bm, float *m, float *l,
                                                               float *acc, const int HD) {
    const float corr = expf(*m - bm); /* 0 on the first block (m = -inf) */
    *l *= corr;
    for (int i = 0; i < HD; i++) acc[i] *= corr;
    for (int j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - bm);
    for (int j = 0; j < n; j++) *l += s[j];
    *m = bm;
}

/* one page row (HD values of one token and KV head) -> float, times mul (fp8: times 2^120 first) */
static inline __attribute__((always_inline)) void load_row(const Args *a, const void *base, const int8_t *exps,
                                                           int64_t row, float *dst, float *mul, const int HD,
                                                           const int fmt) {
    (void)a;
    if (fmt == 0) {
        memcpy(dst, (const float *)base + row * HD, HD * sizeof(float));
        *mul = 1.0f;
    } else if (fmt == 1) {
        const uint16_t *src = (const uint16_t *)base + row * HD;
        for (int i = 0; i < HD; i++) dst[i] = bf16_to_float(src[i]);
        *mul = 1.0f;
    } else {
        const uint8_t *src = (const uint8_t *)base + row * HD;
        const float fix = 0x1p120f;
        for (int i = 0; i < HD; i++) { /* e = 0: 2^-6 (m/8) = m 2^-9, no subnormal operand */
            const uint32_t x = src[i];
            const float mag = (x & 0x78u) ? bits_to_float((x & 0x7Fu) << 20) * fix : (float)(x & 7u) * 0x1p-9f;
            dst[i] = (x & 0x80u) ? -mag : mag;
        }
        *mul = pow2i(exps[row]); /* bits.h: exact, where ldexpf was a library call per token */
    }
}

/* HD and fmt are arguments so that `attend_*` below get copies specialised for the common head sizes and
 * formats: with them known at compile time the HD loops are whole vectors with no remainder. */
static inline __attribute__((always_inline)) void attend_row(const Args *a, int d, int h, const int HD,
                                                             const int fmt) {
    const int G = a->G, S = a->S, KVH = a->KVH;
    const int len = a->lens[d];
    float qbuf[MAX_G * MAX_HD];
    const float *q = load_q(a, d, h, qbuf);
    float acc[MAX_G][MAX_HD];
    float m[MAX_G], l[MAX_G];
    float row[MAX_HD];
    float s[MAX_G][BLOCK];
    float vmul[BLOCK];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    }
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK]; /* the block's page rows, found once for K and V (no division per token) */
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        block_rows(pages, t0, n, S, KVH, h, rows);
        for (int j = 0; j < n; j++) {
            const int64_t r = rows[j];
            float mul;
            load_row(a, a->k, a->ke, r, row, &mul, HD, fmt);
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * HD;
                float dot = 0.0f;
                for (int i = 0; i < HD; i++) dot += qg[i] * row[i];
                s[g][j] = dot * mul * a->scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float bm = m[g];
            for (int j = 0; j < n; j++) bm = s[g][j] > bm ? s[g][j] : bm;
            softmax_step(s[g], n, bm, &m[g], &l[g], acc[g], HD);
        }
        for (int j = 0; j < n; j++) {
            load_row(a, a->v, a->ve, rows[j], row, &vmul[j], HD, fmt);
            for (int g = 0; g < G; g++) {
                const float p = s[g][j] * vmul[j];
                for (int i = 0; i < HD; i++) acc[g][i] += p * row[i];
            }
        }
    }
    for (int g = 0; g < G; g++) store_out(a, d, h, g, acc[g], 1.0f / l[g]);
}

/* A tile's rows one at a time (the generic code: any head size, any CPU). */
static inline __attribute__((always_inline)) void attend_hd(const Args *a, int t, int h, const int HD,
                                                            const int fmt) {
    for (int d = tile_first(a, t); d < tile_first(a, t + 1); d++) attend_row(a, d, h, HD, fmt);
}

#if VECTOR_COPY
/* fp8_e4m3 codes as float16 bits worth 2^-8 of their values: sign-extended to 16 bits and shifted by 7, the sign
 * on 15 and 14 (14 cleared by FP8_HALF_MASK), eeee mmm on 7-13, read by F16C's exact conversion as 2^(e-15) (1 + m/8),
 * or 2^-14 (m/8) for e = 0, where the true values are 2^(e-7) (1 + m/8) and 2^-6 (m/8): subnormal codes too, with
 * no float32 subnormal anywhere (the top of the file). 8, 16 or (AVX512BW, `row32`) 32 codes at a time. */
#define FP8_HALF_MASK ((short)0xBF80)

static inline __m128i fp8x8_half_bits(const uint8_t *src) {
    const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)src)), 7);
    return _mm_and_si128(x, _mm_set1_epi16(FP8_HALF_MASK));
}

static inline __m256i fp8x16_half_bits(const uint8_t *src) {
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src)), 7);
    return _mm256_and_si256(x, _mm256_set1_epi16(FP8_HALF_MASK));
}

/* Prefetch `nrows` consecutive page rows of `base` from `row` on (each HD values of 4, 2 or 1 bytes by fmt: whole
 * 64-byte lines; a token's rows of consecutive KV heads are consecutive) into L2, or into L1 where `l1`. */
static inline __attribute__((always_inline)) void prefetch_rows(const void *base, int64_t row, int nrows,
                                                                const int HD, const int fmt, const int l1) {
    const int bytes = HD << (2 - fmt);
    for (int b = 0; b < bytes * nrows; b += 64) {
        if (l1) _mm_prefetch((const char *)base + row * bytes + b, _MM_HINT_T0);
        else _mm_prefetch((const char *)base + row * bytes + b, _MM_HINT_T1);
    }
}

static inline __attribute__((always_inline)) void prefetch_row(const void *base, int64_t row, const int HD,
                                                               const int fmt) { /* one row, into L2 */
    prefetch_rows(base, row, 1, HD, fmt, 0);
}

/* The page rows that come after the block of tokens t0 .. t0+n-1 of item (tile t, KV heads h .. h+nh-1), for the
 * vector copies to prefetch while that block is computed: this item's next block (head h's rows, into `next`,
 * which the caller then computes), or where there is none the next item's first block (into `first`), blocks of B
 * keys. *pf points at them; returns how many. */
static inline int rows_after(const Args *a, int t, int h, int nh, const int64_t *pages, int t0, int n, int len,
                             int64_t *next, int64_t *first, const int64_t **pf, const int B) {
    int n_next = len - t0 - n < B ? len - t0 - n : B;
    block_rows(pages, t0 + n, n_next, a->S, a->KVH, h, next);
    *pf = next;
    if (n_next == 0 && (h + nh < a->KVH || t + 1 < a->ntiles)) {
        const int t2 = h + nh < a->KVH ? t : t + 1, h2 = h + nh < a->KVH ? h + nh : 0;
        const int d2 = tile_first(a, t2), len2 = a->lens[tile_first(a, t2 + 1) - 1];
        n_next = len2 < B ? len2 : B;
        block_rows(a->table + (int64_t)d2 * a->MAXP, 0, n_next, a->S, a->KVH, h2, first);
        *pf = first;
    }
    return n_next;
}

/* The cache lines of n bytes at p, into L2. */
static inline __attribute__((always_inline)) void prefetch_bytes(const void *p, int64_t n) {
    for (uintptr_t x = (uintptr_t)p & ~(uintptr_t)63; x < (uintptr_t)p + (uintptr_t)n; x += 64)
        _mm_prefetch((const char *)x, _MM_HINT_T1);
}

/* Decode rows (attend_dec8, attend_dec16): key j's share of the next block's prefetches, into L2: its K and V rows
 * of the item's NH heads and, over fp8 pages, at a page's first row the lines of the exponents from that row to the
 * page's end (or a page on, as far: harmless). A page's exponents were one line before, but SmolLM2's 48 bytes
 * straddle two lines in every other page; with both, 32 decode rows x 30 layers over fp8 pages took 0.87-0.98x the
 * time at 512-2,000 keys, three runs (Zen 4 VM, the builds alternating). */
static inline __attribute__((always_inline)) void prefetch_next_key(const Args *a, const int64_t *pf, int j, int NH,
                                                                    const int HD, const int fmt) {
    prefetch_rows(a->k, pf[j], NH, HD, fmt, 0);
    prefetch_rows(a->v, pf[j], NH, HD, fmt, 0);
    if (fmt == 2 && (j == 0 || pf[j] != pf[j - 1] + a->KVH)) {
        prefetch_bytes(a->ke + pf[j], (int64_t)a->S * a->KVH);
        prefetch_bytes(a->ve + pf[j], (int64_t)a->S * a->KVH);
    }
}

/* Decode rows over fp8 pages: the block's tokens' 2^e per KV head h + hh (K's times kscale into kmul, V's into
 * vmul), 1 past its n keys (their weights are 0). Blocks start at a page (BLOCK keys from key 0), so where pages
 * hold 16 tokens of at most 4 KV heads and the CPU has AVX512-VBMI, a page's exponents are one masked load and each
 * head's 16 picked by one `vpermb`, made 2^e by `vscalefps` (the same values as pow2i's); a scalar loop took ~9%
 * of SmolLM2's decode rows over fp8 pages (perf, Zen 4 VM). */
static inline void block_exponents(const Args *a, const int64_t *rows, int n, int h, int NH, float kscale,
                                   float (*kmul)[BLOCK], float (*vmul)[BLOCK]) {
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    if (a->S == 16 && a->KVH <= 4) {
        const __mmask64 page = ~0ull >> (64 - 16 * a->KVH);
        const __m512 one = _mm512_set1_ps(1.0f), ks = _mm512_set1_ps(kscale);
        uint8_t sel[64] __attribute__((aligned(64))) = {0}; /* byte i < 16: token i's exponent of KV head 0 */
        for (int i = 0; i < 16; i++) sel[i] = (uint8_t)(a->KVH * i);
        const __m512i stride = _mm512_load_si512(sel);
        for (int p = 0; p < BLOCK; p += 16) {
            const __mmask16 live = p >= n ? 0 : n - p >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - p)) - 1);
            __m512i ek = _mm512_setzero_si512(), ev = _mm512_setzero_si512();
            if (live) { /* the page's exponents, from its first row (token 0, KV head 0) */
                ek = _mm512_maskz_loadu_epi8(page, a->ke + rows[p] - h);
                ev = _mm512_maskz_loadu_epi8(page, a->ve + rows[p] - h);
            }
            for (int hh = 0; hh < NH; hh++) { /* token i's exponent of head h + hh: byte (h + hh) + KVH i */
                const __m512i idx = _mm512_add_epi8(stride, _mm512_set1_epi8((char)(h + hh)));
                const __m512 e = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(
                    _mm512_permutexvar_epi8(idx, ek))));
                const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(
                    _mm512_permutexvar_epi8(idx, ev))));
                _mm512_store_ps(&kmul[hh][p], _mm512_mask_blend_ps(live, one, _mm512_scalef_ps(ks, e)));
                _mm512_store_ps(&vmul[hh][p], _mm512_mask_blend_ps(live, one, _mm512_scalef_ps(one, f)));
            }
        }
        return;
    }
#endif
    (void)h;
    for (int hh = 0; hh < NH; hh++)
        for (int j = 0; j < BLOCK; j++) {
            kmul[hh][j] = j < n ? pow2i(a->ke[rows[j] + hh]) * kscale : 1.0f;
            vmul[hh][j] = j < n ? pow2i(a->ve[rows[j] + hh]) : 1.0f;
        }
}

/* Prompt tiles with the heads along the lanes (attend_vec8, attend_vec16): tile t's R x G query heads of KV head h
 * transposed into qt [dim][head] (rows MAX_G apart), and the keys each sees (its row's count) into qlf; heads from
 * R x G to `lanes` (the tile's head vectors' lanes) get q = 0 and every key (finite scores, never used). */
static inline void tile_queries(const Args *a, int t, int h, int HD, int lanes, float *qt, float *qlf) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d, G = a->G;
    float qbuf[MAX_G * MAX_HD];
    for (int i = 0; i < R; i++) {
        const float *qi = load_q(a, d + i, h, qbuf);
        for (int g = 0; g < G; g++) {
            for (int c = 0; c < HD; c++) qt[c * MAX_G + i * G + g] = qi[g * HD + c];
            qlf[i * G + g] = (float)a->lens[d + i];
        }
    }
    for (int g = R * G; g < lanes; g++) {
        for (int c = 0; c < HD; c++) qt[c * MAX_G + g] = 0.0f;
        qlf[g] = (float)a->lens[d + R - 1];
    }
}
#endif

#ifdef __AVX512F__
#include "paged_decode_avx512.h" /* 16 lanes: attend_dec16, attend_vec16, attend_pairs16 (AVX512-BF16), attend_vec */
#elif VECTOR_COPY
#include "paged_decode_avx2.h" /* 8 lanes: attend_dec8, attend_vec8 */
#else
#define SPECIALISE(hd, f) static void attend_##hd##_##f(const Args *a, int t, int h) { attend_hd(a, t, h, hd, f); }
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include "paged_decode_amx.h" /* decode rows (and prompt tiles of up to 16 query heads) on AMX tiles: attend_amx */
#else
#define HAVE_AMX 0
#endif

/* Whether decode rows over bf16 or fp8 pages with bf16 q run the AMX tiles where they apply (1, the default) or the
 * vector copy (0); returns whether this build has the AMX copy and the process holds the tile state. */
int paged_decode_set_amx(int on) {
#if HAVE_AMX
    amx_on = on;
    return amx_granted();
#else
    (void)on;
    return 0;
#endif
}

SPECIALISE(64, 0) SPECIALISE(64, 1) SPECIALISE(64, 2) SPECIALISE(128, 0) SPECIALISE(128, 1) SPECIALISE(128, 2)
static void attend_any(const Args *a, int t, int h) { attend_hd(a, t, h, a->HD, a->fmt); }

/* Whether prompt tiles with bfloat16 q over bf16 or fp8 pages score by `vdpbf16ps` here (`attend_pairs16`). */
int paged_decode_pair_tiles(void) { return HAVE_BF16; }

/* fp8 codes to bfloat16 for the tests: n codes (a multiple of 64) by `fp8_row_to_bf16` where `table` (the AMX path's
 * and the dequantiser's conversion; returns 1 where the CPU has no AVX512-VBMI, so no table), else by
 * `fp8x32_to_bf16` (the vector copy's; a multiple of 32); returns -1 where the CPU has no AVX512-BF16 copy. */
int fp8_to_bf16(const uint8_t *src, uint16_t *dst, int n, int table) {
#if HAVE_BF16
    if (table) {
#ifdef __AVX512VBMI__
        for (int i = 0; i + 64 <= n; i += 64) fp8_row_to_bf16(src + i, dst + i, 64);
        return 0;
#else
        return 1;
#endif
    }
    for (int i = 0; i + 32 <= n; i += 32) _mm512_storeu_si512(dst + i, fp8x32_to_bf16(src + i));
    return 0;
#else
    (void)src, (void)dst, (void)n, (void)table;
    return -1;
#endif
}

/* Pages table[0 .. P) of an fp8 pool (codes [.., S, KVH, HD], exponents [.., S, KVH]) as their true values, code
 * x 2^e, into out [P, S, KVH, HD]: bfloat16 (`f32` 0) or float32. Exact either way (an e4m3 code has 3 mantissa
 * bits and 2^e moves only the exponent; bfloat16 has float32's range), the torch dequantiser's values, unless
 * code x 2^e leaves float32's normal range. For prompt chunks: their rows read each key once per tile and a
 * chunk has many tiles, so one conversion per call beats one per tile (`dequantised_pages`). Returns -1 where
 * the CPU has no AVX512-BF16 copy. */
int fp8_pages_dequantise(const uint8_t *codes, const int8_t *exps, const int64_t *table, int P, int S, int KVH,
                         int HD, void *out, int f32) {
#if HAVE_BF16
    if (HD % 32 || HD > MAX_HD) return -1;
    const int64_t rows = (int64_t)S * KVH; /* page rows (token, KV head) of one page */
    for (int p = 0; p < P; p++)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t src = table[p] * rows + r, dst = (int64_t)p * rows + r;
            const __m512 mul = _mm512_set1_ps(pow2i(exps[src]));
            uint16_t row[MAX_HD] __attribute__((aligned(64)));
            fp8_row_to_bf16(codes + src * HD, row, HD);
            for (int c = 0; c < HD; c += 16) {
                const __m512 x = _mm512_mul_ps(bf16x16_to_float(row + c), mul);
                if (f32)
                    _mm512_storeu_ps((float *)out + dst * HD + c, x);
                else /* exact in bfloat16: the top halves */
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + dst * HD + c),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
            }
        }
    return 0;
#else
    (void)codes, (void)exps, (void)table, (void)P, (void)S, (void)KVH, (void)HD, (void)out, (void)f32;
    return -1;
#endif
}

#define MAX_CHUNKS 4096 /* chunks of work items a call is cut into, at most */

typedef struct {
    Args a;
    void (*attend)(const Args *, int, int);
    int items, chunks; /* work items (a tile's KV heads, or one: a.item_heads) and the chunks they are cut into */
} Job;

static void run_chunk(void *ctx, int i) {
    const Job *job = (const Job *)ctx;
    const int begin = (int)((int64_t)job->items * i / job->chunks);
    const int end = (int)((int64_t)job->items * (i + 1) / job->chunks);
#if HAVE_AMX
    const int tiles = job->attend == attend_amx || job->attend == attend_amx_fp8;
    if (tiles) amx_attention_config(); /* for the chunk's decode rows */
#endif
    for (int w = begin; w < end; w++)
        for (int h = w * job->a.item_heads % job->a.KVH, e = h + job->a.item_heads; h < e; h++)
            job->attend(&job->a, w * job->a.item_heads / job->a.KVH, h);
#if HAVE_AMX
    if (tiles) _tile_release();
#endif
}

/* Returns 0, or -1 for shapes beyond the fixed buffers or tiles the kernel cannot take (the caller falls
 * back). q and out: float32, or bfloat16 when `half` (q widened exactly, out rounded to nearest even: the
 * float32 result's rounding). `tiles` (NULL: every row its own): [ntiles + 1] ascending first rows, 0 first
 * and D last; a tile's rows share the first row's page table and see non-decreasing key counts, and a tile
 * holds at most MAX_G query heads (rows x G).
 * Threads: the process's shared pool (kernels/cpu/pool.c), which claims work items one at a time (up to
 * 4096 chunks of them), so a helper that is late costs at most the item it holds; only when the call has
 * at least `min_threaded_rows` (sequence, KV head, key) rows. An item is a tile with all its KV heads, one
 * after the other on one thread (a token's rows of the heads lie side by side in a page: measured in c = 32
 * SmolLM2 decode steps, 4 pairs alternating with one head an item, the attention's time per step 0.78x),
 * or, where there are fewer than 4 tiles a thread, one KV head of a tile. `linger`: how, as pool.h's `run_chunks`
 * (the shared pool, or a region on the caller's OpenMP pool). */
int paged_decode(const void *q, const void *k, const void *v, const int8_t *ke, const int8_t *ve,
                 const int64_t *table, const int32_t *lens, const int32_t *tiles, int ntiles, void *out, int D,
                 int KVH, int G, int HD, int S, int MAXP, int fmt, int half, float scale, int threads,
                 int64_t min_threaded_rows, int linger) {
    if (HD > MAX_HD || G > MAX_G || HD <= 0 || G <= 0) return -1;
    if (tiles) {
        if (ntiles <= 0 || tiles[0] != 0 || tiles[ntiles] != D) return -1;
        for (int t = 0; t < ntiles; t++) {
            if (tiles[t + 1] <= tiles[t] || (tiles[t + 1] - tiles[t]) * G > MAX_G) return -1;
            for (int d = tiles[t] + 1; d < tiles[t + 1]; d++)
                if (lens[d] < lens[d - 1]) return -1;
        }
    } else {
        ntiles = D;
    }
    Job job = {{q, k, v, ke, ve, table, lens, tiles, out, D, KVH, G, HD, S, MAXP, fmt, half, ntiles, scale, KVH},
               attend_any, ntiles, 0};
    if (threads > 1) {
        int64_t rows = 0;
        for (int d = 0; d < D; d++) rows += lens[d];
        if (rows * KVH < min_threaded_rows) threads = 1;
    }
    if (threads > 1 && ntiles < 4 * threads) { /* too few tiles to share out: one KV head an item */
        job.a.item_heads = 1;
        job.items = ntiles * KVH;
    }
    if (HD == 64) job.attend = fmt == 0 ? attend_64_0 : fmt == 1 ? attend_64_1 : attend_64_2;
    if (HD == 128) job.attend = fmt == 0 ? attend_128_0 : fmt == 1 ? attend_128_1 : attend_128_2;
#if HAVE_AMX
    if (amx_on && (fmt == 1 || fmt == 2) && half && S % 16 == 0 && (HD == 64 || HD == 128) &&
        G <= AMX_G && amx_granted())
        job.attend = fmt == 1 ? attend_amx : attend_amx_fp8;
#endif
    job.chunks = job.items < MAX_CHUNKS ? job.items : MAX_CHUNKS;
    run_chunks(run_chunk, &job, job.chunks, threads, linger); /* one thread or one chunk: all on this thread */
    return 0;
}
