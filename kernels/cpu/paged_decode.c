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
 * to bfloat16 (0.61x attend_vec16's time; its section). Decode rows on AMX tiles score by `tdpbf16ps`.
 * Queries come in tiles: one row, or
 * consecutive rows of one prompt chunk (same pages, one more key each) whose query heads run together
 * against each block of keys; a work item is a tile's KV heads (or one of them where tiles are few). Decode
 * rows over bf16 or fp8 pages with bf16 q run on AMX tiles where the CPU has them (`attend_amx`, its section below).
 * Threads: the process's shared helper pool (kernels/cpu/pool.c) over items.
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
#define VECTOR_COPY 1 /* attend_vec (AVX-512) or attend_vec8 (AVX2) below */
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
/* The same attention with AVX-512 intrinsics, for head sizes that are whole vectors (NV = HD / 16). Per
 * block of up to 32 tokens: the block's K rows are widened once into `kb` (fp32 pages are read in place),
 * then for each query head the scores of 16 tokens at a time: one vector of partial sums per token (NV
 * chained FMAs; the 16 tokens are independent chains), folded into one vector of 16 dot products by
 * `sum16` (45 shuffles and adds for 16 dots, where a horizontal sum per dot took ~11 operations each).
 * Each V row is widened once into registers and used by up to 4 query heads, whose outputs stay in
 * registers over the block (`accumulate_v`). The exponent of a token (fp8) is an exact power of two made
 * from its bits (`pow2i`), not a libm call. Sums are float32 in another order than the generic code's
 * (tests compare both to the reference). One thread, 32 sequences x 150 keys, G = 3, HD = 64, bf16
 * pages, a 2-core AMD EPYC VM: 23.6 -> ~14-17 ns per (sequence, KV head, key) row, with the pages in
 * cache. In a decode step they are not: each layer's pages come from memory, a row of 64-256 bytes per
 * token and KV head, page by page, which the hardware prefetchers do not follow. So the rows that come
 * next (the item's next block, or the next item's first) are prefetched into L2 a few per token while
 * the current block is computed. Measured over 30 layers' own page pools (32 sequences, G = 3, HD = 64,
 * random page tables), alternating with the kernel without it, same VM: bf16 pages 0.54-0.73x the
 * time at 80-600 keys (1 and 2 threads), fp8 0.69-0.70x; into L1 instead (the first try): 0.78-1.0x. */
static inline __m512 sum16(const __m512 v[16]) { /* lane j: the sum of v[j]'s 16 lanes */
    __m512 a[8], b[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of v[2k] = x, v[2k+1] = y */
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per 128-bit lane: that lane's sums of v[4k .. 4k+3] */
        const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
        b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* add the four 128-bit lanes: b[k]'s lanes end up in lane k */
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
}

/* e^x for x <= 0 on 16 lanes (-inf and below EXP_CUTOFF: 0; NaN stays NaN), as exp_nonpositive lane by lane. */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 c = _mm512_max_ps(_mm512_set1_ps(EXP_CUTOFF), x); /* the second operand where either is NaN */
    __m512 n;
    const __m512 p = exp_reduced16(c, &n);
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_CUTOFF), _CMP_LT_OQ),
                               _mm512_scalef_ps(p, n));
}

/* 16 values c .. c+15 of page row `row` as float32 (fp8: the codes' values, as load_row: `fp8x16_half_bits`, F16C's
 * conversion, then times 2^8). */
static inline __attribute__((always_inline)) __m512 widen16(const void *base, int64_t row, int c, const int HD,
                                                            const int fmt) {
    if (fmt == 0) return _mm512_loadu_ps((const float *)base + row * HD + c);
    if (fmt == 1) return bf16x16_to_float((const uint16_t *)base + row * HD + c);
    return _mm512_mul_ps(_mm512_cvtph_ps(fp8x16_half_bits((const uint8_t *)base + row * HD + c)),
                         _mm512_set1_ps(0x1p8f));
}

#ifdef __AVX512BF16__
/* 32 fp8_e4m3 values at src as bfloat16 bits, exactly (the true values, no 2^120): for e > 0 the bits
 * move into place and the exponent is rebiased (+120); e = 0 (zero and the subnormals m 2^-9, normal
 * numbers in bfloat16) comes from a table by m, where the bit placement would make bfloat16 subnormals
 * that `vdpbf16ps` reads as zero. Nine simple instructions per 32 values. */
static inline __m512i fp8x32_to_bf16(const uint8_t *src) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07F0)),
                                            _mm512_set1_epi16(120 << 7));
    /* m 2^-9 for m = 0..7 (indexed by w's low 5 bits, which are m where e = 0, signed or not) */
    const __m512i sub = _mm512_permutexvar_epi16(w, _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                     0, 0, 0, 0, 0, 0, 0, 0x3C60, 0x3C40, 0x3C20,
                                                                     0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0));
    const __m512i mag = _mm512_mask_mov_epi16(normal, _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78)), sub);
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}
#endif

#ifdef __AVX512VBMI__
/* fp8x32_to_bf16 for 64 codes by table: the bfloat16 of each of the 128 magnitudes, its high and low bytes in two
 * 128-byte tables that `vpermi2b` reads by the code's low 7 bits (magnitude 0x7f, a NaN, as torch converts it),
 * the sign bit copied in; the two bytes interleaved into 16-bit lanes (the codes put in the order that makes
 * `vpunpck{l,h}bw`'s per-128-bit-lane interleave come out in sequence). 6 instructions a 64 codes where
 * fp8x32_to_bf16 takes 18. Out: codes 0-31 in *lo, 32-63 in *hi. */
static uint8_t fp8_bf16_hi[128] __attribute__((aligned(64))), fp8_bf16_lo[128] __attribute__((aligned(64)));

__attribute__((constructor)) static void fp8_bf16_tables(void) {
    for (int m = 0; m < 128; m++) {
        const int e = m >> 3, f = m & 7;
        const float x = m == 0x7f ? NAN : e ? ldexpf(1.0f + f / 8.0f, e - 7) : ldexpf((float)f, -9);
        const uint16_t b = m == 0x7f ? 0x7fc0 : (uint16_t)(float_to_bits(x) >> 16); /* exact: 4 significant bits */
        fp8_bf16_hi[m] = (uint8_t)(b >> 8), fp8_bf16_lo[m] = (uint8_t)b;
    }
}

static inline __attribute__((always_inline)) void fp8x64_to_bf16(const uint8_t *src, __m512i *lo, __m512i *hi) {
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
        14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
        52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
    const __m512i c = _mm512_permutexvar_epi8(_mm512_load_si512(order), _mm512_loadu_si512(src));
    const __m512i h = _mm512_ternarylogic_epi32(
        _mm512_permutex2var_epi8(_mm512_load_si512(fp8_bf16_hi), c, _mm512_load_si512(fp8_bf16_hi + 64)), c,
        _mm512_set1_epi8((char)0x80), 0xF8); /* the table's byte, or the code's sign bit */
    const __m512i l = _mm512_permutex2var_epi8(_mm512_load_si512(fp8_bf16_lo), c, _mm512_load_si512(fp8_bf16_lo + 64));
    *lo = _mm512_unpacklo_epi8(l, h);
    *hi = _mm512_unpackhi_epi8(l, h);
}
#endif

#ifdef __AVX512BF16__
/* HD fp8 codes (HD a multiple of 32) as their exact bfloat16 values into dst (64-byte aligned): by table
 * (`fp8x64_to_bf16`) where the CPU has AVX512-VBMI and HD is a multiple of 64, else `fp8x32_to_bf16`. */
static inline __attribute__((always_inline)) void fp8_row_to_bf16(const uint8_t *src, uint16_t *dst, int HD) {
#ifdef __AVX512VBMI__
    if (HD % 64 == 0) {
        for (int c = 0; c < HD; c += 64) {
            __m512i lo, hi;
            fp8x64_to_bf16(src + c, &lo, &hi);
            _mm512_store_si512(dst + c, lo);
            _mm512_store_si512(dst + c + 32, hi);
        }
        return;
    }
#endif
    for (int c = 0; c < HD; c += 32) _mm512_store_si512(dst + c, fp8x32_to_bf16(src + c));
}
#endif

/* Page row `row` as float32: fp32 in place, else widened into dst. */
static inline __attribute__((always_inline)) const float *widen_row(const void *base, int64_t row, float *dst,
                                                                     const int HD, const int fmt) {
    if (fmt == 0) return (const float *)base + row * HD;
    for (int c = 0; c < HD; c += 16) _mm512_store_ps(dst + c, widen16(base, row, c, HD, fmt));
    return dst;
}

/* acc[g0 .. g0+GB) += sum over the block's tokens j of w[g][j] * V row j: each V row is widened once into
 * registers and used by GB query heads, whose outputs stay in GB * NV registers (GB * NV independent
 * chains, where one head at a time had NV). */
static inline __attribute__((always_inline)) void accumulate_v(const Args *a, const int64_t *rows, int n,
                                                               float (*w)[BLOCK], float (*acc)[MAX_HD], int g0,
                                                               const int GB, const int HD, const int fmt,
                                                               const int64_t *pf, int npf) {
    enum { NVMAX = MAX_HD / 16 };
    const int NV = HD / 16;
    __m512 o[4][NVMAX];
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) o[g][c] = _mm512_load_ps(&acc[g0 + g][16 * c]);
    for (int j = 0; j < n; j++) {
        if (j < npf) prefetch_row(a->v, pf[j], HD, fmt);
        __m512 v[NVMAX];
        for (int c = 0; c < NV; c++) v[c] = widen16(a->v, rows[j], 16 * c, HD, fmt);
        for (int g = 0; g < GB; g++) {
            const __m512 p = _mm512_set1_ps(w[g0 + g][j]);
            for (int c = 0; c < NV; c++) o[g][c] = _mm512_fmadd_ps(p, v[c], o[g][c]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) _mm512_store_ps(&acc[g0 + g][16 * c], o[g][c]);
}

/* acc[q0 .. q0+GB) += sum over the block's tokens j of w[q][j] * V row j, the V rows already float32 (vr[j]):
 * a tile of more query heads than one group widens each V row once for all its groups. */
static inline __attribute__((always_inline)) void accumulate_vrows(const float *const *vr, int n,
                                                                   float (*w)[BLOCK], float (*acc)[MAX_HD], int q0,
                                                                   const int GB, const int HD) {
    enum { NVMAX = MAX_HD / 16 };
    const int NV = HD / 16;
    __m512 o[4][NVMAX];
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) o[g][c] = _mm512_load_ps(&acc[q0 + g][16 * c]);
    for (int j = 0; j < n; j++) {
        for (int g = 0; g < GB; g++) {
            const __m512 p = _mm512_set1_ps(w[q0 + g][j]);
            for (int c = 0; c < NV; c++) o[g][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr[j] + 16 * c), o[g][c]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) _mm512_store_ps(&acc[q0 + g][16 * c], o[g][c]);
}

/* One work item: KV head h of tile t, rows d .. d+R-1 (R = 1: a decode row). Its NQ = R * G query heads
 * (row i's G heads are queries i*G .. i*G+G-1) run together against each block of keys, so a block's K and V
 * rows are widened once for all of them; query q sees the first lens[d + q / G] keys, and in a block it
 * reaches only in part (the causal diagonal of a prompt chunk) its scores past that are left out of the
 * softmax and its weights there are 0. A tile's rows share their page table (rows of one prompt chunk). */
static inline __attribute__((always_inline)) void attend_vec(const Args *a, int t, int h, const int HD,
                                                             const int fmt) {
    enum { NVMAX = MAX_HD / 16 };
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    const int NV = HD / 16, G = a->G, S = a->S, KVH = a->KVH, NQ = R * G;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    float q[MAX_G * MAX_HD] __attribute__((aligned(64)));
    int qlen[MAX_G];
    for (int i = 0; i < R; i++) {
        const float *qi = load_q(a, d + i, h, q + i * G * HD);
        if (qi != q + i * G * HD) memcpy(q + i * G * HD, qi, sizeof(float) * G * HD);
        for (int g = 0; g < G; g++) qlen[i * G + g] = a->lens[d + i];
    }
    float acc[MAX_G][MAX_HD] __attribute__((aligned(64)));
    float kb[BLOCK][MAX_HD] __attribute__((aligned(64)));
    float vb[BLOCK][MAX_HD] __attribute__((aligned(64)));
    const float *kr[BLOCK], *vr[BLOCK];
    float m[MAX_G], l[MAX_G];
    float s[MAX_G][BLOCK] __attribute__((aligned(64)));
    float kmul[BLOCK];
    for (int g = 0; g < NQ; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    }
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK];
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, S, KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        /* the rows that come next (this item's next block, else the next item's first), prefetched a few
         * at a time while this block is computed: K rows during the first head's scores, V rows during
         * the first heads' sums */
        const int64_t *pf;
        const int n_next = rows_after(a, t, h, 1, pages, t0, n, len, next, first, &pf, BLOCK);
        for (int j = 0; j < n; j++) {
            kr[j] = widen_row(a->k, rows[j], kb[j], HD, fmt);
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * a->scale;
        }
        for (int g = 0; g < NQ; g++) {
            const int nq = qlen[g] - t0 < n ? qlen[g] - t0 : n; /* this query's keys in the block */
            if (nq <= 0) { /* past its last key: no scores, weights 0 */
                for (int j = 0; j < n; j++) s[g][j] = 0.0f;
                continue;
            }
            __m512 qv[NVMAX];
            for (int c = 0; c < NV; c++) qv[c] = _mm512_load_ps(q + g * HD + 16 * c);
            for (int j0 = 0; j0 < n; j0 += 16) {
                __m512 dots[16];
                for (int jj = 0; jj < 16; jj++) {
                    const int j = j0 + jj;
                    if (g == 0 && j < n_next) prefetch_row(a->k, pf[j], HD, fmt);
                    if (j >= nq) {
                        dots[jj] = _mm512_setzero_ps();
                        continue;
                    }
                    __m512 t = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr[j]));
                    for (int c = 1; c < NV; c++) t = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr[j] + 16 * c), t);
                    dots[jj] = t;
                }
                _mm512_store_ps(&s[g][j0], sum16(dots));
            }
            for (int j = 0; j < nq; j++) s[g][j] = s[g][j] * kmul[j];
            /* online softmax over the query's nq keys, as the generic code */
            const __mmask16 lo = nq >= 16 ? 0xffff : (__mmask16)((1u << nq) - 1);
            const __mmask16 hi = nq > 16 ? (__mmask16)((1u << (nq - 16)) - 1) : 0;
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            const __m512 mx = _mm512_max_ps(_mm512_mask_load_ps(ninf, lo, s[g]),
                                            _mm512_mask_load_ps(ninf, hi, s[g] + 16));
            const float top = _mm512_reduce_max_ps(mx);
            softmax_step(s[g], nq, top > m[g] ? top : m[g], &m[g], &l[g], acc[g], HD);
            /* s[g][nq .. n) stays 0: those keys' dots were zero vectors */
        }
        if (fmt == 2) /* the token's 2^e into its weights */
            for (int j = 0; j < n; j++) {
                const float mul = pow2i(a->ve[rows[j]]);
                for (int g = 0; g < NQ; g++) s[g][j] *= mul;
            }
        /* heads in groups that fit the registers: 4 x 4 vectors at HD 64, 2 x 8 at 128 */
        const int GB = HD == 64 ? 4 : 2;
        if (NQ > GB) { /* several groups: widen the block's V rows once, prefetching the next ones */
            for (int j = 0; j < n; j++) {
                if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
                vr[j] = widen_row(a->v, rows[j], vb[j], HD, fmt);
            }
            for (int g0 = 0; g0 < NQ; g0 += GB) {
                const int left = NQ - g0;
                if (left >= 4 && GB == 4) accumulate_vrows(vr, n, s, acc, g0, 4, HD);
                else if (left == 3 && GB == 4) accumulate_vrows(vr, n, s, acc, g0, 3, HD);
                else if (left >= 2) accumulate_vrows(vr, n, s, acc, g0, 2, HD);
                else accumulate_vrows(vr, n, s, acc, g0, 1, HD);
            }
        } else { /* one group (a decode row of up to 4 heads, or 2 at 128): V rows straight from the pages */
            if (NQ == 4) accumulate_v(a, rows, n, s, acc, 0, 4, HD, fmt, pf, n_next);
            else if (NQ == 3) accumulate_v(a, rows, n, s, acc, 0, 3, HD, fmt, pf, n_next);
            else if (NQ == 2) accumulate_v(a, rows, n, s, acc, 0, 2, HD, fmt, pf, n_next);
            else accumulate_v(a, rows, n, s, acc, 0, 1, HD, fmt, pf, n_next);
        }
    }
    for (int g = 0; g < NQ; g++) store_out(a, d + g / G, h, g % G, acc[g], 1.0f / l[g]);
}
/* ---- Decode rows on AVX-512F (Skylake-SP on, with or without AVX512-BF16): attend_dec8's scheme on 16 lanes.
 * A decode row against up to DEC_Q / G of its KV heads at once, each key row read once (a token's rows of those
 * heads lie side by side in a page) and converted in registers, per block of up to 32 keys:
 *   scores: each K row becomes HD / 16 float32 vectors (`row32`: a bf16 row gives 32 dims a 64-byte load, the even
 *     dims by a shift and the odd ones by a mask, so the lanes hold dims c, c + 2, ... then c + 1, c + 3, ...; q and
 *     the output are kept in that order and put back at the end; fp32 and fp8 rows in dim order), and each of its
 *     query heads' dots with it two chains of FMAs into one vector of partial sums; `sum16` folds 16 keys' vectors
 *     into their 16 scores;
 *   softmax: 16 scores a vector (`exp_nonpositive16`), keys past the block's end masked to -inf;
 *   values: per KV head, 64 dims of up to DEC16_PV of its query heads' outputs in registers over the block's keys,
 *     each V row's 64 dims converted once for all of them.
 * fp8 pages (AVX512-BW for the 16-bit lanes): row32 converts by float16 (`_mm512_cvtph_ps`, exact), 2^-8 of the
 * values; the 2^8 goes into the scores' multiplier with the token's 2^e and the scale, and into the output's 1 / l,
 * the V rows' 2^e into the weights (after their sum: l is the weights' sum), as attend_dec8.
 * Sums are float32 in another order than attend_vec's (per head: two chains over HD, then sum16's tree); the
 * exponentials are the same polynomial. Against attend_vec, which decode rows took here before: SmolLM2's shape
 * (3 KV heads x 3, HD = 64), 32 sequences x 30 layers' own page pools (page tables shuffled), 2 threads, a 2-core
 * Ice Lake-SP VM, the builds alternating in one process (medians of 9): bf16 pages 0.91x the time at 256 keys and
 * 0.83x at 1,024, fp8 pages 0.76x and 0.89x; one thread over pages in cache (4 sequences, one layer's pool) bf16
 * 0.70x, fp8 0.82x; fp32 pages 0.97-1.02x, so they stay with attend_vec. attend_dec8 itself (the AVX2 copy, 8
 * lanes) measured 0.93x / 0.83x over bf16 pages and 0.98x / 1.06x over fp8 in the same runs. */
#ifdef __AVX512BW__
#define DEC16_FP8 1
#else
#define DEC16_FP8 0
#endif
#define DEC16_PV 6 /* query heads whose outputs one pass over a block's V rows holds: 6 x 4 vectors at 64 dims */

/* Dims c .. c+31 of page row `row` as two float32 vectors in attend_dec16's lane order (see above). */
static inline __attribute__((always_inline)) void row32(const void *base, int64_t row, int c, const int HD,
                                                        const int fmt, __m512 *lo, __m512 *hi) {
    if (fmt == 0) {
        *lo = _mm512_loadu_ps((const float *)base + row * HD + c);
        *hi = _mm512_loadu_ps((const float *)base + row * HD + c + 16);
    } else if (fmt == 1) {
        const __m512i x = _mm512_loadu_si512((const uint16_t *)base + row * HD + c);
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else { /* fp8: as `fp8x16_half_bits`, 32 codes */
#if DEC16_FP8
        const __m256i b = _mm256_loadu_si256((const __m256i *)((const uint8_t *)base + row * HD + c));
        const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                                           _mm512_set1_epi16(FP8_HALF_MASK));
        *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
#endif
    }
}

/* Query heads g0 .. g0+NG-1 (NG <= DEC16_PV): outputs o[g] (rescaled by corr[g] first) plus the block's n V rows
 * weighted by w[g * wh + j * wk] (head g, key j; any layout of the weights), 64 dims at a time, each V row's 64
 * dims loaded once for all NG heads: vr[j], float32, where fmt is -1 (prompt tiles: rows widened once a block);
 * else page row rows[j] + hh of the V pages in format fmt, converted in registers by row32 (decode rows). As
 * attend_dec8's accumulate_v8 on 8 lanes; fmt is a constant in each copy, so the choice is made at compile time. */
static inline __attribute__((always_inline)) void accumulate_v16(const Args *a, const int64_t *rows, int hh,
                                                                 const float *const *vr, int n, const float *w,
                                                                 const int wh, const int wk, const float *corr,
                                                                 float (*o)[MAX_HD], int g0, const int NG,
                                                                 const int HD, const int fmt) {
    for (int c = 0; c < HD; c += 64) {
        __m512 x[DEC16_PV][4];
        for (int i = 0; i < NG; i++) {
            const __m512 ci = _mm512_set1_ps(corr[g0 + i]);
            for (int u = 0; u < 4; u++) x[i][u] = _mm512_mul_ps(_mm512_load_ps(&o[g0 + i][c + 16 * u]), ci);
        }
        for (int j = 0; j < n; j++) {
            __m512 v[4];
            if (fmt < 0) {
                for (int u = 0; u < 4; u++) v[u] = _mm512_loadu_ps(vr[j] + c + 16 * u);
            } else {
                row32(a->v, rows[j] + hh, c, HD, fmt, &v[0], &v[1]);
                row32(a->v, rows[j] + hh, c + 32, HD, fmt, &v[2], &v[3]);
            }
            for (int i = 0; i < NG; i++) {
                const __m512 p = _mm512_set1_ps(w[(g0 + i) * wh + j * wk]);
                for (int u = 0; u < 4; u++) x[i][u] = _mm512_fmadd_ps(p, v[u], x[i][u]);
            }
        }
        for (int i = 0; i < NG; i++)
            for (int u = 0; u < 4; u++) _mm512_store_ps(&o[g0 + i][c + 16 * u], x[i][u]);
    }
}

/* KV heads h .. h+NH-1 of decode row t, its NQ = NH x G query heads (head hh's g-th is query hh * G + g), NQ <=
 * DEC_Q; HD a multiple of 64. */
static inline __attribute__((always_inline)) void attend_dec16(const Args *a, int t, int h, int NH, const int HD,
                                                               const int fmt) {
    const int d = tile_first(a, t), G = a->G, NQ = NH * G, len = a->lens[d];
    float q[DEC_Q * MAX_HD] __attribute__((aligned(64))); /* in row32's lane order */
    float acc[DEC_Q][MAX_HD] __attribute__((aligned(64)));
    float part[BLOCK][DEC_Q][16] __attribute__((aligned(64))); /* per key and query head: 16 partial sums */
    float s[DEC_Q][BLOCK] __attribute__((aligned(64)));
    float kmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(64))); /* fp8, per KV head and key: 2^e 2^8 scale */
    float vmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(64))); /* 2^e */
    float m[DEC_Q], l[DEC_Q], corr[DEC_Q];
    for (int hh = 0; hh < NH; hh++) {
        float qbuf[MAX_G * MAX_HD];
        const float *qd = load_q(a, d, h + hh, qbuf);
        float *qh = q + hh * G * HD;
        for (int i = 0; i < G * HD; i += 32) /* bf16: each 32 dims' even ones, then the odd ones */
            for (int j = 0; j < 16; j++) {
                qh[i + j] = qd[i + (fmt == 1 ? 2 * j : j)];
                qh[i + 16 + j] = qd[i + (fmt == 1 ? 2 * j + 1 : 16 + j)];
            }
    }
    for (int g = 0; g < NQ; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    }
    const __m512 scale = _mm512_set1_ps(a->scale), ninf = _mm512_set1_ps(-INFINITY);
    const float kscale = a->scale * 256.0f; /* fp8: row32's rows are 2^-8 of the values, K's and V's */
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK]; /* head h's page rows (head h + hh's: rows + hh) */
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are read */
        const int n_next = rows_after(a, t, h, NH, pages, t0, n, len, next, first, &pf, BLOCK);
        if (fmt == 2) /* the tokens' 2^e (K's times scale and row32's 2^8) */
            block_exponents(a, rows, n, h, NH, kscale, kmul, vmul);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_next_key(a, pf, j, NH, HD, fmt); /* a key's at a time */
            for (int hh = 0; hh < NH; hh++)
                for (int c0 = 0; c0 < HD; c0 += 128) { /* 8 vectors of the row at a time */
                    const int nv = HD - c0 < 128 ? (HD - c0) / 16 : 8;
                    __m512 k[8];
                    for (int c = 0; c < nv; c += 2) row32(a->k, rows[j] + hh, c0 + 16 * c, HD, fmt, &k[c], &k[c + 1]);
                    for (int g = hh * G; g < hh * G + G; g++) {
                        const float *qg = q + g * HD + c0;
                        __m512 x0 = _mm512_mul_ps(_mm512_load_ps(qg), k[0]);
                        __m512 x1 = _mm512_mul_ps(_mm512_load_ps(qg + 16), k[1]);
                        for (int c = 2; c < nv; c += 2) {
                            x0 = _mm512_fmadd_ps(_mm512_load_ps(qg + 16 * c), k[c], x0);
                            x1 = _mm512_fmadd_ps(_mm512_load_ps(qg + 16 * c + 16), k[c + 1], x1);
                        }
                        __m512 x = _mm512_add_ps(x0, x1);
                        if (c0) x = _mm512_add_ps(x, _mm512_load_ps(part[j][g]));
                        _mm512_store_ps(part[j][g], x);
                    }
                }
        }
        if (fmt != 0) /* the block's V rows from L2 into L1 while the softmax runs (fp32's would evict K's) */
            for (int j = 0; j < n; j++) prefetch_rows(a->v, rows[j], NH, HD, fmt, 1);
        const int nb = (n + 15) / 16; /* vectors of 16 keys; lanes past n masked */
        for (int g = 0; g < NQ; g++) {
            __m512 top = _mm512_set1_ps(m[g]);
            for (int b = 0; b < nb; b++) {
                __m512 v[16];
                for (int jj = 0; jj < 16; jj++) v[jj] = _mm512_load_ps(part[16 * b + jj][g]);
                const int left = n - 16 * b;
                const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
                const __m512 mul = fmt == 2 ? _mm512_load_ps(&kmul[g / G][16 * b]) : scale;
                const __m512 sc = _mm512_mask_mul_ps(ninf, live, sum16(v), mul); /* keys past n: -inf */
                _mm512_store_ps(&s[g][16 * b], sc);
                top = _mm512_max_ps(top, sc);
            }
            const float bm = _mm512_reduce_max_ps(top); /* >= m[g] */
            corr[g] = exp_nonpositive(m[g] - bm);       /* 0 on the first block (m = -inf) */
            const __m512 bmv = _mm512_set1_ps(bm);
            __m512 sum = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const __m512 w = exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(&s[g][16 * b]), bmv));
                sum = _mm512_add_ps(sum, w);
                _mm512_store_ps(&s[g][16 * b], fmt == 2 ? _mm512_mul_ps(w, _mm512_load_ps(&vmul[g / G][16 * b])) : w);
            }
            l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(sum);
            m[g] = bm;
        }
        for (int hh = 0; hh < NH; hh++) /* each KV head's V rows converted once for up to DEC16_PV of its heads */
            for (int g = hh * G; g < hh * G + G; g += DEC16_PV) {
                switch (hh * G + G - g) {
                case 1: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 1, HD, fmt); break;
                case 2: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 2, HD, fmt); break;
                case 3: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 3, HD, fmt); break;
                case 4: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 4, HD, fmt); break;
                case 5: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 5, HD, fmt); break;
                default: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 6, HD, fmt);
                }
            }
    }
    for (int g = 0; g < NQ; g++) { /* back in dim order */
        float o[MAX_HD];
        for (int i = 0; i < HD; i += 32)
            for (int j = 0; j < 16; j++) {
                o[i + (fmt == 1 ? 2 * j : j)] = acc[g][i + j];
                o[i + (fmt == 1 ? 2 * j + 1 : 16 + j)] = acc[g][i + 16 + j];
            }
        store_out(a, d, h + g / G, g % G, o, (fmt == 2 ? 256.0f : 1.0f) / l[g]);
    }
}

/* ---- Prompt tiles on AVX-512F (bf16 q over bf16 or fp8 pages on AVX512-BF16 CPUs: `attend_pairs16`, below): the AVX2
 * copy's prompt tiles (`attend_vec8`, its comment) on 16 lanes: a tile's NQ = R x G query heads (up to MAX_G) of one
 * KV head along the lanes, 16 a vector (NHV16 <= 2 vectors), K and V rows widened to float32 once a block
 * (`widen_row`), scores S^T [key][head] by broadcasts of a key's dims times Q^T's vectors (KB keys x NHV16 vectors of
 * accumulators), the softmax lane by lane, and the outputs O [head][dim] over the V rows, 64 dims of up to DEC16_PV
 * heads in registers (`tile_values16`). Against attend_vec, which prompt tiles took here before, 100 prompt rows in
 * tiles of 10 (SmolLM2's shape), 30 layers, the builds alternating in one process on a 2-core Ice Lake-SP VM: after
 * 256 keys bf16 pages 0.55-0.64x the time, fp8 ~0.6x, fp32 0.51-0.55x; from key 0 bf16 0.55-0.85x, fp8 0.75-0.9x, fp32
 * 0.63-0.64x. */
#define TILE_HV16 (MAX_G / 16) /* head vectors of a tile, at most */
static const float zero_row[MAX_HD] __attribute__((aligned(64))); /* the K row of a key past a block's end */

/* A prompt tile's running state at its start: each head vector's key counts (qlf) into qlen, maxima -inf, sums 0,
 * and the NQ heads' outputs 0. */
static inline __attribute__((always_inline)) void tile_start16(const float *qlf, int NHV, int NQ, const int HD,
                                                              __m512 *qlen, __m512 *m, __m512 *l,
                                                              float (*acc)[MAX_HD]) {
    for (int v = 0; v < TILE_HV16; v++) { /* past NHV: unused */
        qlen[v] = v < NHV ? _mm512_load_ps(qlf + 16 * v) : _mm512_setzero_ps();
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
    }
    for (int g = 0; g < NQ; g++)
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
}

/* Keys j0 .. j0+KB-1's scores (acc[k][v]: key k, head vector v) times their multipliers into st, -inf for a head
 * whose row does not see the key, and each head's running block maximum into top. */
static inline __attribute__((always_inline)) void tile_scores_out16(__m512 (*acc)[TILE_HV16], int j0, int n,
                                                                   int key0, const float *mul, const __m512 *qlen,
                                                                   float (*st)[MAX_G], __m512 *top, const int NHV,
                                                                   const int KB) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < KB && j0 + k < n; k++) {
        const __m512 key = _mm512_set1_ps((float)(key0 + j0 + k)), m = _mm512_set1_ps(mul[j0 + k]);
        for (int v = 0; v < NHV; v++) {
            const __m512 s = _mm512_mask_mul_ps(ninf, _mm512_cmp_ps_mask(key, qlen[v], _CMP_LT_OQ), acc[k][v], m);
            _mm512_store_ps(&st[j0 + k][16 * v], s);
            top[v] = _mm512_max_ps(top[v], s);
        }
    }
}

/* The tile's NQ heads' outputs acc / l into out (rows d .. of KV head h). */
static inline void tile_finish16(const Args *a, int d, int h, int NQ, int NHV, const __m512 *l,
                                 float (*acc)[MAX_HD]) {
    float lf[MAX_G] __attribute__((aligned(64)));
    for (int v = 0; v < NHV; v++) _mm512_store_ps(lf + 16 * v, l[v]);
    for (int g = 0; g < NQ; g++) store_out(a, d + g / a->G, h, g % a->G, acc[g], 1.0f / lf[g]);
}

/* Scores of keys j0 .. j0+KB-1 (rows kr[]) for the tile's NHV head vectors, as attend_vec8's tile_scores. */
static inline __attribute__((always_inline)) void tile_scores16(const float *qt, const float *const *kr, int j0, int n,
                                                               int key0, const float *mul, const __m512 *qlen,
                                                               float (*st)[MAX_G], __m512 *top, const int HD,
                                                               const int NHV, const int KB) {
    __m512 acc[8][TILE_HV16];
    for (int k = 0; k < KB; k++)
        for (int v = 0; v < NHV; v++) acc[k][v] = _mm512_setzero_ps();
    for (int c = 0; c < HD; c++) {
        __m512 qv[TILE_HV16];
        for (int v = 0; v < NHV; v++) { /* in registers: not a memory operand of every FMA */
            qv[v] = _mm512_load_ps(qt + c * MAX_G + 16 * v);
            __asm__("" : "+v"(qv[v]));
        }
        for (int k = 0; k < KB; k++) {
            const __m512 x = _mm512_set1_ps(kr[j0 + k][c]);
            for (int v = 0; v < NHV; v++) acc[k][v] = _mm512_fmadd_ps(x, qv[v], acc[k][v]);
        }
    }
    tile_scores_out16(acc, j0, n, key0, mul, qlen, st, top, NHV, KB);
}

/* The online softmax of a block's n keys for every head at once, as attend_vec8's tile_softmax. */
static inline __attribute__((always_inline)) void tile_softmax16(float (*st)[MAX_G], int n, const __m512 *top,
                                                                const float *wmul, __m512 *m, __m512 *l, float *corr,
                                                                const int NHV) {
    for (int v = 0; v < NHV; v++) {
        const __m512 bm = _mm512_max_ps(m[v], top[v]); /* finite: every head sees key 0 */
        const __m512 cv = exp_nonpositive16(_mm512_sub_ps(m[v], bm));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            const __m512 w = exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(&st[j][16 * v]), bm));
            sum = _mm512_add_ps(sum, w);
            _mm512_store_ps(&st[j][16 * v], wmul ? _mm512_mul_ps(w, _mm512_set1_ps(wmul[j])) : w);
        }
        l[v] = _mm512_fmadd_ps(l[v], cv, sum);
        m[v] = bm;
        _mm512_store_ps(corr + 16 * v, cv);
    }
}

/* Outputs of the tile's NQ heads: acc[g] = acc[g] corr[g] + the block's n V rows (vr) weighted by st[key][g], in
 * passes of DEC16_PV heads (accumulate_v16). */
static inline __attribute__((always_inline)) void tile_values16(float (*acc)[MAX_HD], const float (*st)[MAX_G],
                                                               const float *const *vr, int n, const float *corr,
                                                               int NQ, const int HD) {
    const float *w = st[0];
    int g0 = 0;
    for (; g0 + DEC16_PV <= NQ; g0 += DEC16_PV)
        accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, DEC16_PV, HD, -1);
    switch (NQ - g0) {
    case 1: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 1, HD, -1); break;
    case 2: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 2, HD, -1); break;
    case 3: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 3, HD, -1); break;
    case 4: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 4, HD, -1); break;
    case 5: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 5, HD, -1); break;
    default: break;
    }
}

/* One work item: KV head h of prompt tile t (rows d .. d+R-1, R > 1), HD a multiple of 64. */
static inline __attribute__((always_inline)) void attend_vec16(const Args *a, int t, int h, const int HD,
                                                               const int fmt) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    const int G = a->G, NQ = R * G, NHV = (NQ + 15) / 16;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    float qt[MAX_HD * MAX_G] __attribute__((aligned(64))); /* [dim][head] */
    float qlf[MAX_G] __attribute__((aligned(64)));
    tile_queries(a, t, h, HD, 16 * NHV, qt, qlf);
    __m512 qlen[TILE_HV16], m[TILE_HV16], l[TILE_HV16];
    float acc[MAX_G][MAX_HD] __attribute__((aligned(64)));
    tile_start16(qlf, NHV, NQ, HD, qlen, m, l, acc);
    float kb[BLOCK * MAX_HD] __attribute__((aligned(64))); /* rows HD apart (attend_vec8: L1 sets) */
    float vb[BLOCK * MAX_HD] __attribute__((aligned(64)));
    float st[BLOCK][MAX_G] __attribute__((aligned(64)));
    float corr[MAX_G] __attribute__((aligned(64)));
    const float *kr[BLOCK + 8], *vr[BLOCK];
    float kmul[BLOCK], vmul[BLOCK];
    for (int j = BLOCK; j < BLOCK + 8; j++) kr[j] = zero_row;
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK];
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are widened */
        const int n_next = rows_after(a, t, h, 1, pages, t0, n, len, next, first, &pf, BLOCK);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->k, pf[j], HD, fmt);
            kr[j] = widen_row(a->k, rows[j], kb + j * HD, HD, fmt);
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * a->scale;
        }
        for (int j = n; j < BLOCK; j++) kr[j] = zero_row;
        __m512 top[TILE_HV16];
        for (int v = 0; v < NHV; v++) top[v] = _mm512_set1_ps(-INFINITY);
        if (NHV == 1)
            for (int j0 = 0; j0 < n; j0 += 8) tile_scores16(qt, kr, j0, n, t0, kmul, qlen, st, top, HD, 1, 8);
        else
            for (int j0 = 0; j0 < n; j0 += 6) tile_scores16(qt, kr, j0, n, t0, kmul, qlen, st, top, HD, 2, 6);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
            vr[j] = widen_row(a->v, rows[j], vb + j * HD, HD, fmt);
            if (fmt == 2) vmul[j] = pow2i(a->ve[rows[j]]); /* the token's 2^e into its weights */
        }
        if (NHV == 1) tile_softmax16(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 1);
        else tile_softmax16(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 2);
        tile_values16(acc, (const float (*)[MAX_G])st, vr, n, corr, NQ, HD);
    }
    tile_finish16(a, d, h, NQ, NHV, l, acc);
}

#if HAVE_BF16
/* Prompt tiles with bfloat16 queries over bf16 or fp8 pages, on CPUs with AVX512-BF16: attend_vec16's tile (the
 * query heads along the lanes, outer products, the online softmax lane-wise), its two products by `vdpbf16ps`,
 * which sums two bfloat16 products into each float32 lane, so each instruction does the work of two FMAs:
 *   scores: lane i of a Q vector holds query head i's dims c, c+1 as a bfloat16 pair (the tile's queries in that
 *     layout once, `tile_query_pairs`), times key j's dims c, c+1 broadcast as one 32-bit word straight from the
 *     page row (fp8 rows: their exact bfloat16 values in L1 first, `fp8_row_to_bf16`). Exact products, summed in
 *     float32 as attend_vec16 sums them but pairwise.
 *   values: keys 2p, 2p+1's V rows interleaved once a block into words of (dim c of one, dim c of the other)
 *     (`value_pairs`), times a query head's weights of those two keys broadcast as one word. The weights enter
 *     rounded to bfloat16, as flash attention on GPUs and the AMX tiles round them, and the softmax's sum adds the
 *     rounded weights, so the output is within a few bfloat16 rounding units (2^-8) of its magnitude where
 *     attend_vec16 is within one (tests/kernels/test_cpu_paged_attention.py bounds it by 3, as for the AMX tiles).
 *   softmax: since the weights are rounded to bfloat16, they are powers of two by the AMX tiles' short polynomial
 *     (`exp2_weights16`) of scores that come times log2 e, and two keys' weights are rounded and paired in one
 *     conversion and one permute (`tile_softmax_pairs`), in blocks of PAIR_BLOCK keys.
 * Over fp8 pages the token's 2^e multiplies the scores and, after rounding, the weights (exact), as in
 * attend_vec16, so a call over the pages dequantised to bfloat16 first (`fp8_pages_dequantise`) gives the same
 * bits. Per key and tile of 30 query heads (SmolLM2: 10 rows x G = 3) at 64 dims, 124 `vdpbf16ps` where
 * attend_vec16 has 248 FMAs. Measured on a 2-core Zen 4 VM, 2 threads, the two builds alternating in one process:
 * one prompt chunk of SmolLM2's shape in tiles of 10 rows, 30 calls, 1,024 rows 233-246 -> 142-161 ms over bf16
 * pages, 234-238 -> 145-147 over fp8 (~255 GFLOP/s where the GEMMs run at ~410); 2,048 rows 902-912 -> 549-562
 * and 907-912 -> 567-581. A bfloat16 engine's lone-prompt TTFT: 1,024 tokens 813-825 -> 718-737 ms, 2,048
 * 2,105-2,114 -> 1,743-1,781 (FP8 pages: 836-850 -> 740-754, 2,111-2,142 -> 1,746-1,760). The softmax in base 2,
 * blocks of 64 and the queries' prefetch then (medians, same harness): 1,024 rows 163 -> 139 ms over bf16 pages,
 * 167 -> 140 over fp8, 2,048 rows 585 -> 523 (~290 GFLOP/s); TTFT by the minima 0.94-0.97x at 1,024-4,096 tokens. */

/* x rounded to bfloat16 (nearest even), as float32: the bfloat16 bits in each lane's top half, zeros below. */
static inline __m512 round_bf16_hi(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* acc + per lane i: x's bfloat16 pair i times y's, both products summed (`vdpbf16ps`). */
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i x, __m512i y) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
}

#define LOG2E 1.44269504088896341f
#define EXP2_CUTOFF (EXP_CUTOFF * LOG2E) /* the weights' floor e^EXP_CUTOFF, as a power of two: -86.6 */

/* 2^x for the softmax's weights, which are rounded to bfloat16 next: x = n + r (n = rint(x), |r| <= 1/2), 2^r by a
 * degree-4 polynomial (Taylor of e^(r ln 2); truncation < 5e-5 relative, against the 2^-9 of that rounding), then
 * scaled by 2^n. Below EXP2_CUTOFF 0, as the vector copies' floor (its comment: a weight there, times an fp8 token's
 * 2^e, was a float32 subnormal, a microcode assist, then flushed by the bfloat16 rounding anyway). NaN stays NaN.
 * -inf gives 0. The AMX tiles and the pair tiles (`tile_softmax_pairs`) take their weights from it. */
static inline __m512 exp2_weights16(__m512 x) {
    const __m512 c = _mm512_max_ps(_mm512_set1_ps(EXP2_CUTOFF), x); /* the second operand where either is NaN */
    const __m512 n = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(c, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0096181291f), r, _mm512_set1_ps(0.0555041087f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402265070f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471806f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP2_CUTOFF), _CMP_LT_OQ), p, n);
}

/* The bfloat16 query rows of the work item after (tile t, KV head h) on this thread (run_chunk's order), into L2:
 * a tile's first reads of its queries missed the caches (~3% of a SmolLM2 prompt chunk's time). */
static inline void prefetch_next_queries(const Args *a, int t, int h) {
    const int t2 = h + 1 < a->KVH ? t : t + 1, h2 = h + 1 < a->KVH ? h + 1 : 0;
    if (t2 >= a->ntiles) return;
    const int d = tile_first(a, t2), R = tile_first(a, t2 + 1) - d;
    const int64_t bytes = (int64_t)a->G * a->HD * 2;
    for (int i = 0; i < R; i++)
        prefetch_bytes((const uint16_t *)a->q + ((int64_t)(d + i) * a->KVH + h2) * a->G * a->HD, bytes);
}

/* Tile t's R x G bfloat16 query heads of KV head h as pairs: qp[c / 2][head] the word (dim c, dim c+1); heads from
 * R x G to `lanes` zero, and each head's key count in qlf (tile_queries' layout, words for floats). */
static inline void tile_query_pairs(const Args *a, int t, int h, int HD, int lanes, uint32_t *qp, float *qlf) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d, G = a->G;
    for (int i = 0; i < R; i++) {
        const uint32_t *qi = (const uint32_t *)((const uint16_t *)a->q + ((int64_t)(d + i) * a->KVH + h) * G * HD);
        for (int g = 0; g < G; g++) {
            for (int c = 0; c < HD / 2; c++) qp[c * MAX_G + i * G + g] = qi[g * HD / 2 + c];
            qlf[i * G + g] = (float)a->lens[d + i];
        }
    }
    for (int g = R * G; g < lanes; g++) {
        for (int c = 0; c < HD / 2; c++) qp[c * MAX_G + g] = 0;
        qlf[g] = (float)a->lens[d + R - 1];
    }
}

/* Scores of keys j0 .. j0+KB-1 (bfloat16 rows kr[]) for the tile's NHV head vectors, as tile_scores16. */
static inline __attribute__((always_inline)) void tile_scores_pairs(const uint32_t *qp, const uint16_t *const *kr,
                                                                   int j0, int n, int key0, const float *mul,
                                                                   const __m512 *qlen, float (*st)[MAX_G],
                                                                   __m512 *top, const int HD, const int NHV,
                                                                   const int KB) {
    __m512 acc[8][TILE_HV16];
    for (int k = 0; k < KB; k++)
        for (int v = 0; v < NHV; v++) acc[k][v] = _mm512_setzero_ps();
    for (int c = 0; c < HD / 2; c++) {
        __m512i qv[TILE_HV16];
        for (int v = 0; v < NHV; v++) {
            qv[v] = _mm512_load_si512(qp + c * MAX_G + 16 * v);
            __asm__("" : "+v"(qv[v]));
        }
        for (int k = 0; k < KB; k++) {
            const __m512i x = _mm512_set1_epi32(((const int32_t *)kr[j0 + k])[c]);
            for (int v = 0; v < NHV; v++) acc[k][v] = dot_pairs(acc[k][v], qv[v], x);
        }
    }
    tile_scores_out16(acc, j0, n, key0, mul, qlen, st, top, NHV, KB);
}

/* The online softmax of a block's n keys for every head at once (tile_softmax16's), in base 2: the scores come times
 * log2 e, each weight is 2^(s - m) by `exp2_weights16` and the running sums' correction 2^(m - m') too (l and the
 * outputs take the same factor, so its few 1e-5 of error cancel in their quotient). The weights of keys 2p, 2p+1,
 * times the tokens' 2^e over fp8 pages (wmul, exact), are rounded to bfloat16 as one word per head into wp[p] (key
 * 2p's low, 2p+1's high; a key past n weighs 0) by one `vcvtne2ps2bf16` and a `vpermw`, and the sum adds the
 * rounded weights without their 2^e by `vdpbf16ps` against winv[p], the words of the keys' 2^-e (NULL: ones). */
static inline __attribute__((always_inline)) void tile_softmax_pairs(float (*st)[MAX_G], int n,
                                                                    const __m512 *top, const float *wmul,
                                                                    const uint32_t *winv, __m512 *m, __m512 *l,
                                                                    float *corr, uint32_t (*wp)[MAX_G],
                                                                    const int NHV) {
    /* word i of the result: lane i of the first operand (low), lane i of the second (high) */
    const __m512i spread = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ones = _mm512_set1_epi16(0x3F80); /* bfloat16 1.0 */
    for (int v = 0; v < NHV; v++) {
        const __m512 bm = _mm512_max_ps(m[v], top[v]); /* finite: every head sees key 0 */
        const __m512 cv = exp2_weights16(_mm512_sub_ps(m[v], bm));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 2) {
            __m512 w0 = exp2_weights16(_mm512_sub_ps(_mm512_load_ps(&st[j][16 * v]), bm)), w1 = _mm512_setzero_ps();
            if (j + 1 < n) w1 = exp2_weights16(_mm512_sub_ps(_mm512_load_ps(&st[j + 1][16 * v]), bm));
            if (wmul) {
                w0 = _mm512_mul_ps(w0, _mm512_set1_ps(wmul[j]));
                if (j + 1 < n) w1 = _mm512_mul_ps(w1, _mm512_set1_ps(wmul[j + 1]));
            }
            const __m512i w = _mm512_permutexvar_epi16(spread, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
            sum = dot_pairs(sum, w, winv ? _mm512_set1_epi32((int32_t)winv[j / 2]) : ones);
            _mm512_store_si512(&wp[j / 2][16 * v], w);
        }
        l[v] = _mm512_fmadd_ps(l[v], cv, sum);
        m[v] = bm;
        _mm512_store_ps(corr + 16 * v, cv);
    }
}

/* Bfloat16 rows r0 and r1 as words (r0's dim c, r1's dim c), dims in order, into dst [HD]. */
static inline __attribute__((always_inline)) void value_pairs(const uint16_t *r0, const uint16_t *r1, uint32_t *dst,
                                                             const int HD) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int c = 0; c < HD; c += 32) {
        const __m512i x = _mm512_loadu_si512(r0 + c), y = _mm512_loadu_si512(r1 + c);
        _mm512_store_si512(dst + c, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_store_si512(dst + c + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
}

/* Query heads g0 .. g0+NG-1 (NG <= DEC16_PV): o[g] = o[g] corr[g] + the block's np key pairs' V words vp[p] times
 * their weights wp[p][g], 64 dims at a time (accumulate_v16's scheme, two keys an instruction). */
static inline __attribute__((always_inline)) void accumulate_pairs(uint32_t (*vp)[MAX_HD], int np,
                                                                  uint32_t (*wp)[MAX_G], const float *corr,
                                                                  float (*o)[MAX_HD], int g0, const int NG,
                                                                  const int HD) {
    for (int c = 0; c < HD; c += 64) {
        __m512 x[DEC16_PV][4];
        for (int i = 0; i < NG; i++) {
            const __m512 ci = _mm512_set1_ps(corr[g0 + i]);
            for (int u = 0; u < 4; u++) x[i][u] = _mm512_mul_ps(_mm512_load_ps(&o[g0 + i][c + 16 * u]), ci);
        }
        for (int p = 0; p < np; p++) {
            __m512i v[4];
            for (int u = 0; u < 4; u++) v[u] = _mm512_load_si512(&vp[p][c + 16 * u]);
            for (int i = 0; i < NG; i++) {
                const __m512i w = _mm512_set1_epi32((int32_t)wp[p][g0 + i]);
                for (int u = 0; u < 4; u++) x[i][u] = dot_pairs(x[i][u], w, v[u]);
            }
        }
        for (int i = 0; i < NG; i++)
            for (int u = 0; u < 4; u++) _mm512_store_ps(&o[g0 + i][c + 16 * u], x[i][u]);
    }
}

/* Keys per softmax block of attend_pairs16: twice BLOCK, so that the outputs' reload and correction and the block's
 * setup come half as often (its buffers ~30 KB at 64 dims, L1's size on Zen 4). SmolLM2's 1,024-row chunk (the
 * measurement above), 32 -> 64: 128 -> 120 ms; GLM-4.5's shape (128 dims) even. */
#define PAIR_BLOCK 64

/* One work item: KV head h of prompt tile t (rows d .. d+R-1, R > 1), bfloat16 q, fmt 1 or 2, HD a multiple of 64. */
static inline __attribute__((always_inline)) void attend_pairs16(const Args *a, int t, int h, const int HD,
                                                                 const int fmt) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    const int G = a->G, NQ = R * G, NHV = (NQ + 15) / 16;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    uint32_t qp[MAX_HD / 2 * MAX_G] __attribute__((aligned(64))); /* [dim pair][head] */
    float qlf[MAX_G] __attribute__((aligned(64)));
    tile_query_pairs(a, t, h, HD, 16 * NHV, qp, qlf);
    prefetch_next_queries(a, t, h);
    __m512 qlen[TILE_HV16], m[TILE_HV16], l[TILE_HV16];
    float acc[MAX_G][MAX_HD] __attribute__((aligned(64)));
    tile_start16(qlf, NHV, NQ, HD, qlen, m, l, acc);
    uint16_t kb[fmt == 2 ? PAIR_BLOCK : 1][MAX_HD] __attribute__((aligned(64))); /* fp8: the rows as bfloat16 */
    uint16_t vb[fmt == 2 ? PAIR_BLOCK : 1][MAX_HD] __attribute__((aligned(64)));
    uint32_t vp[PAIR_BLOCK / 2][MAX_HD] __attribute__((aligned(64)));
    uint32_t wp[PAIR_BLOCK / 2][MAX_G] __attribute__((aligned(64)));
    float st[PAIR_BLOCK][MAX_G] __attribute__((aligned(64)));
    float corr[MAX_G] __attribute__((aligned(64)));
    const uint16_t *kr[PAIR_BLOCK + 8], *vr[PAIR_BLOCK + 1];
    float kmul[PAIR_BLOCK], vmul[PAIR_BLOCK];
    uint32_t vinv[PAIR_BLOCK / 2];
    const float scale2 = a->scale * LOG2E; /* scores in base 2 (tile_softmax_pairs) */
    for (int j = 0; j < PAIR_BLOCK + 8; j++) kr[j] = (const uint16_t *)zero_row;
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[PAIR_BLOCK], next[PAIR_BLOCK], first[PAIR_BLOCK];
    block_rows(pages, 0, len < PAIR_BLOCK ? len : PAIR_BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += PAIR_BLOCK) {
        const int n = len - t0 < PAIR_BLOCK ? len - t0 : PAIR_BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are read */
        const int n_next = rows_after(a, t, h, 1, pages, t0, n, len, next, first, &pf, PAIR_BLOCK);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->k, pf[j], HD, fmt);
            if (fmt == 2) {
                fp8_row_to_bf16((const uint8_t *)a->k + rows[j] * HD, kb[j], HD);
                kr[j] = kb[j];
            } else {
                kr[j] = (const uint16_t *)a->k + rows[j] * HD;
            }
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * scale2;
        }
        for (int j = n; j < PAIR_BLOCK; j++) kr[j] = (const uint16_t *)zero_row;
        __m512 top[TILE_HV16];
        for (int v = 0; v < NHV; v++) top[v] = _mm512_set1_ps(-INFINITY);
        if (NHV == 1)
            for (int j0 = 0; j0 < n; j0 += 8) tile_scores_pairs(qp, kr, j0, n, t0, kmul, qlen, st, top, HD, 1, 8);
        else
            for (int j0 = 0; j0 < n; j0 += 6) tile_scores_pairs(qp, kr, j0, n, t0, kmul, qlen, st, top, HD, 2, 6);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
            if (fmt == 2) {
                fp8_row_to_bf16((const uint8_t *)a->v + rows[j] * HD, vb[j], HD);
                vr[j] = vb[j];
                vmul[j] = pow2i(a->ve[rows[j]]); /* the token's 2^e into its weights, 2^-e out of their sum */
                const uint32_t inv = float_to_bits(pow2i(-a->ve[rows[j]])) >> 16; /* exact in bfloat16 */
                vinv[j / 2] = j % 2 ? vinv[j / 2] | inv << 16 : inv;
            } else {
                vr[j] = (const uint16_t *)a->v + rows[j] * HD;
            }
        }
        vr[n] = (const uint16_t *)zero_row; /* the pair of an odd block's last key */
        for (int p = 0; 2 * p < n; p++) value_pairs(vr[2 * p], vr[2 * p + 1], vp[p], HD);
        if (NHV == 1) tile_softmax_pairs(st, n, top, fmt == 2 ? vmul : NULL, fmt == 2 ? vinv : NULL, m, l, corr, wp, 1);
        else tile_softmax_pairs(st, n, top, fmt == 2 ? vmul : NULL, fmt == 2 ? vinv : NULL, m, l, corr, wp, 2);
        const int np = (n + 1) / 2;
        int g0 = 0;
        for (; g0 + DEC16_PV <= NQ; g0 += DEC16_PV) accumulate_pairs(vp, np, wp, corr, acc, g0, DEC16_PV, HD);
        switch (NQ - g0) { /* the last heads, fewer than DEC16_PV: a copy per count */
        case 1: accumulate_pairs(vp, np, wp, corr, acc, g0, 1, HD); break;
        case 2: accumulate_pairs(vp, np, wp, corr, acc, g0, 2, HD); break;
        case 3: accumulate_pairs(vp, np, wp, corr, acc, g0, 3, HD); break;
        case 4: accumulate_pairs(vp, np, wp, corr, acc, g0, 4, HD); break;
        case 5: accumulate_pairs(vp, np, wp, corr, acc, g0, 5, HD); break;
        default: break;
        }
    }
    tile_finish16(a, d, h, NQ, NHV, l, acc);
}
#endif

/* A work item on AVX-512F CPUs: decode rows take attend_dec16 (fp8 pages only with AVX512-BW), prompt tiles
 * attend_vec16 (every format; bf16 q over bf16 or fp8 pages attend_pairs16 where the CPU has AVX512-BF16), the
 * rest attend_vec. Over fp32 pages attend_dec16 measured as fast as attend_vec
 * (32 rows of 512 keys, 30 layers, Zen 4 VM: 36.0-36.7 ms against 33.3-36.9); it takes them too so that a prompt
 * chunk's one-row last tile over FP8 pages dequantised to float32 gives the bits the call over the FP8 pages
 * gives, as the other rows do (tests/kernels/test_cpu_paged_attention.py). On CPUs with
 * AVX512-BF16 too, since 2026-12-07: there attend_vec had scored bf16 q by `vdpbf16ps`, each query head on its
 * own, every dot folded across lanes. Zen 4 VM, 2 threads, the builds alternating twice: `bench cpu-kernels`' 32
 * decode rows x 30 layers, 512 keys, fp8 pages 33.1 -> 17.3 ms, bf16 23.2 -> 22.3; 2,000 keys fp8 96.7-100.1 ->
 * 63.7-65.9, bf16 81.8-85.3 -> 75.8-76.3; a 1,024-token prompt's attention in the engine (SmolLM2 bfloat16, 30
 * layers) 389-446 -> 245-274 ms, 2,048 tokens 1,530-1,622 -> 965-1,059. */
static inline __attribute__((always_inline)) void attend_vec_dec(const Args *a, int t, int h, const int HD,
                                                                 const int fmt) {
    const int d = tile_first(a, t);
    if ((fmt <= 1 || DEC16_FP8) && HD % 64 == 0 && tile_first(a, t + 1) == d + 1 &&
        a->G <= DEC_Q) { /* a decode row: an item of its KV heads, DEC_Q / G */
        const int per = a->item_heads == 1 ? 1 : DEC_Q / a->G;
        if (h % per == 0) attend_dec16(a, t, h, a->KVH - h < per ? a->KVH - h : per, HD, fmt);
        return; /* the other heads of its group: done with the first */
    }
    if (HD % 64 == 0 && tile_first(a, t + 1) > d + 1) { /* a prompt tile */
#if HAVE_BF16
        if (a->half && fmt >= 1) {
            attend_pairs16(a, t, h, HD, fmt);
            return;
        }
#endif
        attend_vec16(a, t, h, HD, fmt);
    } else
        attend_vec(a, t, h, HD, fmt);
}
#define SPECIALISE(hd, f) static void attend_##hd##_##f(const Args *a, int t, int h) { attend_vec_dec(a, t, h, hd, f); }
#elif VECTOR_COPY
/* The AVX2 copies, for CPUs with AVX2 and FMA but no AVX-512, head sizes 64 and 128 (NV = HD / 8 vectors), float32,
 * bfloat16 or fp8 pages (no bfloat16 dot products here: rows are converted to float32): decode rows in
 * `attend_dec8`, prompt tiles in `attend_vec8` (their sections below). The decode rows' history: before
 * `attend_dec8` they ran a scheme like attend_vec's (each query head's scores 8 tokens at a time, 8 chains of FMAs
 * folded by `sum8`), which against the generic code it replaced, one thread, 30 layers' own page pools (32
 * sequences, G = 3, HD = 64, page tables shuffled), the two builds alternating in one process on a 2-core AMD EPYC
 * VM (Zen 3) took: bf16 pages 0.79x the time at 150 keys, 0.69x at 600; fp8 0.57x and 0.48x (~44 and ~36 ns per
 * sequence, KV head and key); pages in cache 0.84x and 0.73x. Without the prefetches 1.13x (bf16) and 1.54x (fp8)
 * its time; issued one per token among the scores and sums instead of a burst per block, 1.04-1.3x. */
static inline __m256 sum8(const __m256 v[8]) { /* lane j: the sum of v[j]'s 8 lanes */
    __m256 a[4], b[2];
    for (int k = 0; k < 4; k++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of v[2k] = x, v[2k+1] = y */
        a[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++) { /* per 128-bit lane: that lane's sums of v[4k .. 4k+3] */
        const __m256d x = _mm256_castps_pd(a[2 * k]), y = _mm256_castps_pd(a[2 * k + 1]);
        b[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    /* add the two 128-bit lanes: b[k]'s sums end up in lanes 4k .. 4k+3 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

/* Page row `row` as float32: fp32 in place, else widened into dst (fp8: the codes' values, as load_row). */
static inline __attribute__((always_inline)) const float *widen_row8(const void *base, int64_t row, float *dst,
                                                                      const int HD, const int fmt) {
    if (fmt == 0) return (const float *)base + row * HD;
    for (int c = 0; c < HD; c += 8) {
        __m256 v;
        if (fmt == 1) {
            v = bf16x8_to_float((const uint16_t *)base + row * HD + c);
        } else { /* as widen16: by float16 where the CPU has F16C, else the float32 bits (load_row's) */
            const uint8_t *src = (const uint8_t *)base + row * HD + c;
#ifdef __F16C__
            v = _mm256_mul_ps(_mm256_cvtph_ps(fp8x8_half_bits(src)), _mm256_set1_ps(0x1p8f));
#else
            const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src));
            const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32((int)0x87FFFFFFu));
            v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
#endif
        }
        _mm256_store_ps(dst + c, v);
    }
    return dst;
}

/* ---- Decode rows on AVX2: a decode row (a tile of one row, what each sequence of a decode
 * step is) against all its KV heads at once, every key row read once and kept in registers.
 * Prompt tiles (attend_vec8 below) convert a block's K and V rows into float32 buffers, one KV head an item. Here
 * an item's KV heads run together (up to DEC_Q query heads; SmolLM2's 3 KV heads x 3),
 * so a token's rows of those heads, which lie side by side in the page, are read as one span; per block of up to
 * 32 keys:
 *   scores: each K row becomes HD / 8 float32 vectors in registers (`row16`: a bf16 row gives 16 dims a 32-byte
 *     load, the even dims by a shift and the odd ones by a mask, so the lanes hold dims c, c + 2, ... then c + 1,
 *     c + 3, ...; q and the output are kept in that order and put back at the end), and each of its query heads'
 *     dots with it is two chains of FMAs into one vector of partial sums (`part`); `sum8` folds 8 keys' vectors
 *     into their 8 scores;
 *   softmax: 8 scores a vector (`exp_nonpositive8`: exp_reduced's operations lane by lane), keys past the block's
 *     end masked to -inf;
 *   values: per query head its output stays in registers over the block's keys, each V row converted in registers
 *     as K's (the rescale by the new maximum folded into loading the output); over fp8 pages per KV head instead,
 *     16 dims of up to 4 query heads' outputs in registers, so that each V row is converted once
 *     (`accumulate_v8`). The block's V rows (bf16, fp8) are prefetched from L2 into L1 before the softmax.
 * fp8 pages (where the CPU has F16C): row16 converts by float16, 2^-8 of the values; the 2^8 goes into the
 * scores' multiplier with the token's 2^e and the scale, and into the output's 1 / l, the V rows' 2^e into the
 * weights (after their sum: l is the weights' sum).
 * Sums are float32 in another order than attend_vec8's (per head: two chains over HD, then the lanes' tree); the
 * exponentials are the same polynomial. A 2-core AMD EPYC VM (AVX2, Zen 3 flags), SmolLM2's shape (3 KV heads x 3,
 * HD = 64), 32 sequences x 30 layers' own pools, 2 threads, the two copies alternating in one process: bf16 pages
 * 0.99x attend_vec8's time at 128 keys, 0.85x at 256, 0.90x at 1,024, fp32 pages 0.82x at 512; with the pages in
 * L2 (2 sequences, one thread) 0.80x. The pages come from memory in a decode step, and there the pattern of reads
 * (128 of every 384 bytes of a token's row, pages scattered; a plain C loop reading the same bytes gets ~8 GB/s
 * on one core, ~11 GB/s whole rows) bounds both copies more than their arithmetic. Over fp8 pages a first try of
 * this loop (V rows converted per query head, by attend_vec8's float32 bit placement) took 1.09x attend_vec8's
 * time; as above, with V's prefetches spread over the K loop, 0.79x at 128-1,024 keys (in L2 0.83x), bf16 pages
 * 0.88x, fp32 0.92x (the L1 prefetch for bf16 and fp8 only: fp32's 24 KB of a block's V rows would evict K's).
 * V's loop per KV head took 1.12-1.16x the time over fp32 rows (each 16-dim pass reads a quarter of a 256-byte
 * row) and 1.01x over bf16: they keep theirs. */
#define TILE_PV 6 /* query heads whose outputs one pass over a block's V rows holds (accumulate_v8) */
#ifdef __F16C__
#define DEC8_FP8 1 /* fp8 rows converted by float16 (row16) */
#else
#define DEC8_FP8 0
#endif

/* e^x for x <= 0 on 8 lanes, as exp_nonpositive: below EXP_CUTOFF (and -inf) 0; NaN stays NaN. */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 c = _mm256_max_ps(_mm256_set1_ps(EXP_CUTOFF), x); /* the second operand where either is NaN */
    __m256 n;
    const __m256 p = exp_reduced8(c, &n);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(EXP_CUTOFF), _CMP_LT_OQ),
                            _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Lanes i with i < k all ones (keys within a block's live part), the others zero. */
static inline __m256 lanes_below8(int k) {
    return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)k), _CMP_LT_OQ);
}

/* The largest of v's 8 lanes, in every lane. */
static inline __m256 max_all8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
    return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
}

/* One block of a query head's online softmax on 8 lanes: its scores s[0 .. 8 nb) (lanes past its keys -inf), top
 * their lanes' maxima with its running max m (unreduced). s becomes the weights (times wmul's lanes where given, V's
 * 2^e, after their sum), m and the running sum l move on; returns e^(old m - new m), the rescale of what came
 * before (0 on the first block, m = -inf). */
static inline __attribute__((always_inline)) float softmax_block8(float *s, int nb, __m256 top, const float *wmul,
                                                                  float *m, float *l) {
    top = max_all8(top);
    const float bm = _mm256_cvtss_f32(top), corr = exp_nonpositive(*m - bm);
    __m256 sum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256 w = exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(s + 8 * b), top));
        _mm256_store_ps(s + 8 * b, wmul ? _mm256_mul_ps(w, _mm256_load_ps(wmul + 8 * b)) : w);
        sum = _mm256_add_ps(sum, w);
    }
    *l = *l * corr + hsum8(sum);
    *m = bm;
    return corr;
}

/* Dims c .. c+15 of page row `row` as two float32 vectors in attend_dec8's lane order: bf16 the even dims then the
 * odd ones (one 32-byte load, a shift and a mask); fp32 and fp8 c .. c+7 then c+8 .. c+15. fp8 by float16: the
 * e4m3 bits s eeee mmm placed as float16 bits s 0eeee mmm0000000 read as 2^(e-15) (1 + m/8), or 2^-14 (m/8) for
 * e = 0, where the true values are 2^(e-7) (1 + m/8) and 2^-6 (m/8): exactly 2^-8 of them (F16C's conversion is
 * exact, subnormals too); the caller folds 2^8 into the token's 2^e. */
static inline __attribute__((always_inline)) void row16(const void *base, int64_t row, int c, const int HD,
                                                        const int fmt, __m256 *lo, __m256 *hi) {
    if (fmt == 0) {
        *lo = _mm256_loadu_ps((const float *)base + row * HD + c);
        *hi = _mm256_loadu_ps((const float *)base + row * HD + c + 8);
    } else if (fmt == 1) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + row * HD + c));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else { /* fp8: `fp8x16_half_bits` */
#if DEC8_FP8
        const __m256i h = fp8x16_half_bits((const uint8_t *)base + row * HD + c);
        *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
#endif
    }
}

/* NG query heads' outputs o (rows MAX_HD apart, each rescaled by corr[i] first) plus the block's n keys' V rows
 * weighted by w[i * wh + j * wk] (head i, key j; any layout of the weights), 16 dims at a time: their 2 NG output
 * vectors stay in registers and each V row's 16 dims are loaded (and converted) once for all of them. V row j: vr[j],
 * float32, where given (prompt tiles: rows widened once a block); else page row rows[j] + hh of v, converted in
 * registers by row16 (decode rows over fp8 pages). */
static inline __attribute__((always_inline)) void accumulate_v8(const void *v, const int64_t *rows, int hh,
                                                                const float *const *vr, int n, const float *w,
                                                                const int wh, const int wk, const float *corr,
                                                                float (*o)[MAX_HD], const int HD, const int fmt,
                                                                const int NG) {
    for (int c = 0; c < HD; c += 16) {
        __m256 x[TILE_PV][2]; /* a fixed size (NG <= TILE_PV): registers once unrolled */
        for (int i = 0; i < NG; i++) {
            const __m256 ci = _mm256_set1_ps(corr[i]);
            x[i][0] = _mm256_mul_ps(_mm256_load_ps(&o[i][c]), ci);
            x[i][1] = _mm256_mul_ps(_mm256_load_ps(&o[i][c + 8]), ci);
        }
        for (int j = 0; j < n; j++) {
            __m256 lo, hi;
            if (vr) {
                lo = _mm256_loadu_ps(vr[j] + c);
                hi = _mm256_loadu_ps(vr[j] + c + 8);
            } else {
                row16(v, rows[j] + hh, c, HD, fmt, &lo, &hi);
            }
            for (int i = 0; i < NG; i++) {
                const __m256 p = _mm256_broadcast_ss(&w[i * wh + j * wk]);
                x[i][0] = _mm256_fmadd_ps(p, lo, x[i][0]);
                x[i][1] = _mm256_fmadd_ps(p, hi, x[i][1]);
            }
        }
        for (int i = 0; i < NG; i++) {
            _mm256_store_ps(&o[i][c], x[i][0]);
            _mm256_store_ps(&o[i][c + 8], x[i][1]);
        }
    }
}

/* KV heads h .. h+NH-1 of decode row t (fp32 or bf16 pages), its NQ = NH x G query heads (head hh's g-th is query
 * hh * G + g), NQ <= DEC_Q. */
static inline __attribute__((always_inline)) void attend_dec8(const Args *a, int t, int h, int NH, const int HD,
                                                              const int fmt) {
    const int d = tile_first(a, t), G = a->G, NQ = NH * G, NV = HD / 8, len = a->lens[d];
    float q[DEC_Q * MAX_HD] __attribute__((aligned(32))); /* in row16's lane order */
    float acc[DEC_Q][MAX_HD] __attribute__((aligned(32)));
    float part[BLOCK][DEC_Q][8] __attribute__((aligned(32))); /* per key and query head: 8 partial sums of its dot */
    float s[DEC_Q][BLOCK] __attribute__((aligned(32)));
    float kmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(32))); /* fp8, per KV head and key: 2^e 2^8 scale */
    float vmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(32))); /* 2^e */
    float m[DEC_Q], l[DEC_Q], corr[DEC_Q];
    for (int hh = 0; hh < NH; hh++) {
        float qbuf[MAX_G * MAX_HD];
        const float *qd = load_q(a, d, h + hh, qbuf);
        float *qh = q + hh * G * HD;
        for (int i = 0; i < G * HD; i += 16) /* bf16: each 16 dims' even ones, then the odd ones */
            for (int j = 0; j < 8; j++) {
                qh[i + j] = qd[i + (fmt == 1 ? 2 * j : j)];
                qh[i + 8 + j] = qd[i + (fmt == 1 ? 2 * j + 1 : 8 + j)];
            }
    }
    for (int g = 0; g < NQ; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    }
    const __m256 scale = _mm256_set1_ps(a->scale);
    const float kscale = a->scale * 256.0f; /* fp8: row16's rows are 2^-8 of the values, K's and V's */
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK]; /* head h's page rows (head h + hh's: rows + hh) */
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are read */
        const int n_next = rows_after(a, t, h, NH, pages, t0, n, len, next, first, &pf, BLOCK);
        if (fmt == 2) /* the tokens' 2^e (K's times scale and row16's 2^8) */
            block_exponents(a, rows, n, h, NH, kscale, kmul, vmul);
        for (int j = 0; j < n; j++) {
            if (j < n_next) /* a key's at a time (V's in a burst after the scores: 1.06-1.14x the time) */
                prefetch_next_key(a, pf, j, NH, HD, fmt);
            for (int hh = 0; hh < NH; hh++)
                for (int c0 = 0; c0 < HD; c0 += 64) { /* 8 vectors of the row at a time */
                    const int nv = HD - c0 < 64 ? (HD - c0) / 8 : 8;
                    __m256 k[8];
                    for (int c = 0; c < nv; c += 2) row16(a->k, rows[j] + hh, c0 + 8 * c, HD, fmt, &k[c], &k[c + 1]);
                    for (int g = hh * G; g < hh * G + G; g++) {
                        const float *qg = q + g * HD + c0;
                        __m256 x0 = _mm256_mul_ps(_mm256_load_ps(qg), k[0]);
                        __m256 x1 = _mm256_mul_ps(_mm256_load_ps(qg + 8), k[1]);
                        for (int c = 2; c < nv; c += 2) {
                            x0 = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * c), k[c], x0);
                            x1 = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * c + 8), k[c + 1], x1);
                        }
                        __m256 x = _mm256_add_ps(x0, x1);
                        if (c0) x = _mm256_add_ps(x, _mm256_load_ps(part[j][g]));
                        _mm256_store_ps(part[j][g], x);
                    }
                }
        }
        if (fmt != 0) /* the block's V rows from L2 into L1 while the softmax runs (fp32's 24 KB would evict K's) */
            for (int j = 0; j < n; j++) prefetch_rows(a->v, rows[j], NH, HD, fmt, 1);
        const int nb = (n + 7) / 8; /* vectors of 8 keys; lanes past n masked */
        __m256 live[BLOCK / 8];    /* the lanes of keys within the block */
        for (int b = 0; b < nb; b++) live[b] = lanes_below8(n - 8 * b);
        for (int g = 0; g < NQ; g++) {
            __m256 top = _mm256_set1_ps(m[g]);
            for (int b = 0; b < nb; b++) {
                __m256 v[8];
                for (int jj = 0; jj < 8; jj++) v[jj] = _mm256_load_ps(part[8 * b + jj][g]);
                const __m256 mul = fmt == 2 ? _mm256_load_ps(&kmul[g / G][8 * b]) : scale;
                const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(sum8(v), mul), live[b]);
                _mm256_store_ps(&s[g][8 * b], sc);
                top = _mm256_max_ps(top, sc);
            }
            corr[g] = softmax_block8(s[g], nb, top, fmt == 2 ? vmul[g / G] : NULL, &m[g], &l[g]);
        }
        if (fmt == 2) /* fp8: each V row converted once, for up to 4 of its query heads at a time */
            for (int hh = 0; hh < NH; hh++)
                for (int g = hh * G; g < hh * G + G; g += 4) {
                    const float *w = s[g], *cg = corr + g;
                    float(*o)[MAX_HD] = acc + g;
                    switch (hh * G + G - g) {
                    case 1: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 1); break;
                    case 2: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 2); break;
                    case 3: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 3); break;
                    default: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 4);
                    }
                }
        else /* whole rows per query head: over fp32 and bf16 rows 0.86-0.99x the time of the loop above */
            for (int g = 0; g < NQ; g++)
                for (int c0 = 0; c0 < NV; c0 += 8) { /* 8 vectors of the output in registers */
                    const int nv = NV - c0 < 8 ? NV - c0 : 8;
                    const __m256 cg = _mm256_set1_ps(corr[g]);
                    __m256 o[8];
                    for (int c = 0; c < nv; c++) o[c] = _mm256_mul_ps(_mm256_load_ps(&acc[g][8 * (c0 + c)]), cg);
                    for (int j = 0; j < n; j++) {
                        const __m256 p = _mm256_set1_ps(s[g][j]);
                        for (int c = 0; c < nv; c += 2) {
                            __m256 lo, hi;
                            row16(a->v, rows[j] + g / G, 8 * (c0 + c), HD, fmt, &lo, &hi);
                            o[c] = _mm256_fmadd_ps(p, lo, o[c]);
                            o[c + 1] = _mm256_fmadd_ps(p, hi, o[c + 1]);
                        }
                    }
                    for (int c = 0; c < nv; c++) _mm256_store_ps(&acc[g][8 * (c0 + c)], o[c]);
                }
    }
    for (int g = 0; g < NQ; g++) { /* back in dim order */
        float o[MAX_HD];
        for (int i = 0; i < HD; i += 16)
            for (int j = 0; j < 8; j++) {
                o[i + (fmt == 1 ? 2 * j : j)] = acc[g][i + j];
                o[i + (fmt == 1 ? 2 * j + 1 : 8 + j)] = acc[g][i + 8 + j];
            }
        store_out(a, d, h + g / G, g % G, o, (fmt == 2 ? 256.0f : 1.0f) / l[g]);
    }
}


static const float zero_row[MAX_HD] __attribute__((aligned(32))); /* the K row of a key past a block's end */

/* ---- Prompt tiles on AVX2: a tile's NQ = R x G query heads (up to MAX_G) of one KV head, the heads along the
 * lanes, 8 a vector (NHV vectors), against blocks of BLOCK keys:
 *   scores: S^T [key][head] = K . Q^T, Q transposed once per item (qt [dim][head], heads past NQ zero), so a
 *     score vector is one key's scores for 8 heads: per dim a key's value broadcast times qt's vectors, KB keys
 *     x NHV head vectors of accumulators in registers (`tile_scores`: 6 loads for 8 FMAs at NHV = 4); no
 *     horizontal sums. Lanes past a head's own keys (its row's count, `qlen`) are -inf;
 *   softmax lane by lane, every head at once: a block's maximum, the weights and their sum are vertical
 *     operations over its keys' rows (`tile_softmax`);
 *   values: O [head][dim] += P^T [head][key] . V, 6 heads x 16 dims of outputs in registers over the block's keys
 *     (`tile_values`, by decode rows' `accumulate_v8`: per key 2 loads of V and 6 broadcasts of weights for 12
 *     FMAs), the rescale by the new
 *     maximum folded into loading O.
 * The K and V rows are widened to float32 once a block (`widen_row8`, fp32 pages read in place; fp8 times 2^120),
 * each token's 2^e (fp8) into the scores' multiplier and into the weights after their sum. Sums are float32: a
 * score is one chain of FMAs over HD, the weights' sum per key in order (another order than the decode rows' and
 * the generic code's; tests compare each with the reference).
 * Before (to 2026-12-06): per query head the scores of 8 keys as 8 dot-product chains folded by `sum8` (9 loads
 * for 8 FMAs, then the lanes' tree), the softmax per head, and each head's output over the V rows alone (9 loads
 * for 8 FMAs); the scores took ~8 cycles a (query head, key) where their FMAs need 4. SmolLM2's shape (G = 3, HD =
 * 64, tiles of 10 rows), a 512-row chunk whose keys end at 4,000, 30 layers' own pools, the two copies alternating
 * in one process on a 2-core AMD EPYC VM (Zen 3): bf16 pages 0.71-0.75x the time, fp8 0.65-0.74x, fp32 0.75x;
 * chunks of 100 and 256 rows from key 1 0.68-0.94x (this VM's noise is that wide); in an engine, the attention
 * of a 4,000-token prompt 0.70x, of a 1,000-token one 0.71x, their TTFT 0.81x and 0.92x. The accumulators are
 * fixed-size arrays (a VLA of them stayed in memory: 2x the time), and qt's vectors are pinned in registers (gcc
 * made them memory operands of every FMA: 10 loads for 8 FMAs). The steps of a block switch on NHV each: one copy
 * of the whole tile per NHV compiled this file in 21 s instead of 9. */
#define TILE_HV (MAX_G / 8) /* head vectors of a tile, at most */

/* Scores of keys j0 .. j0+KB-1 (rows kr[]) for the tile's NHV head vectors: st[j] = K_j . qt, times mul[j],
 * -inf in lanes whose head sees fewer than key + 1 keys (qlen); returns them folded into top's maxima (keys
 * from n on are not stored: their rows are zero_row). */
static inline __attribute__((always_inline)) void tile_scores(const float *qt, const float *const *kr, int j0, int n,
                                                             int key0, const float *mul, const __m256 *qlen,
                                                             float (*st)[MAX_G], __m256 *top, const int HD,
                                                             const int NHV, const int KB) {
    __m256 acc[8][TILE_HV]; /* fixed sizes (KB <= 8): registers once unrolled, where a VLA stays in memory */
    for (int k = 0; k < KB; k++)
        for (int v = 0; v < NHV; v++) acc[k][v] = _mm256_setzero_ps();
    for (int c = 0; c < HD; c++) {
        __m256 qv[TILE_HV];
        for (int v = 0; v < NHV; v++) { /* in registers: gcc would reload them as operands of every FMA */
            qv[v] = _mm256_load_ps(qt + c * MAX_G + 8 * v);
            __asm__("" : "+x"(qv[v]));
        }
        for (int k = 0; k < KB; k++) {
            const __m256 x = _mm256_broadcast_ss(kr[j0 + k] + c);
            for (int v = 0; v < NHV; v++) acc[k][v] = _mm256_fmadd_ps(x, qv[v], acc[k][v]);
        }
    }
    for (int k = 0; k < KB && j0 + k < n; k++) {
        const __m256 key = _mm256_set1_ps((float)(key0 + j0 + k)), m = _mm256_set1_ps(mul[j0 + k]);
        for (int v = 0; v < NHV; v++) {
            const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(acc[k][v], m),
                                              _mm256_cmp_ps(key, qlen[v], _CMP_LT_OQ));
            _mm256_store_ps(&st[j0 + k][8 * v], s);
            top[v] = _mm256_max_ps(top[v], s);
        }
    }
}

/* The online softmax of a block's n keys for every head at once (lanes): scores st become weights (times wmul[j],
 * V's 2^e, after their sum, where given); m and l, the heads' running maxima and sums, move on; corr gets each
 * head's rescale of what came before, e^(old m - new m) (0 on the first block). */
static inline __attribute__((always_inline)) void tile_softmax(float (*st)[MAX_G], int n, const __m256 *top,
                                                              const float *wmul, __m256 *m, __m256 *l, float *corr,
                                                              const int NHV) {
    for (int v = 0; v < NHV; v++) {
        const __m256 bm = _mm256_max_ps(m[v], top[v]); /* finite: every head sees key 0 */
        const __m256 cv = exp_nonpositive8(_mm256_sub_ps(m[v], bm));
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const __m256 w = exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(&st[j][8 * v]), bm));
            sum = _mm256_add_ps(sum, w);
            _mm256_store_ps(&st[j][8 * v], wmul ? _mm256_mul_ps(w, _mm256_set1_ps(wmul[j])) : w);
        }
        l[v] = _mm256_fmadd_ps(l[v], cv, sum);
        m[v] = bm;
        _mm256_store_ps(corr + 8 * v, cv);
    }
}

/* A block's scores for NHV head vectors (a constant after the switch), KB keys a pass (registers: KB x NHV
 * accumulators, NHV of qt, the broadcasts). */
static inline __attribute__((always_inline)) void tile_scores_all(const float *qt, const float *const *kr, int n,
                                                                 int key0, const float *mul, const __m256 *qlen,
                                                                 float (*st)[MAX_G], __m256 *top, const int HD,
                                                                 const int NHV) {
    const int KB = NHV == 4 ? 2 : NHV == 3 ? 3 : NHV == 2 ? 4 : 8;
    for (int j0 = 0; j0 < n; j0 += KB) tile_scores(qt, kr, j0, n, key0, mul, qlen, st, top, HD, NHV, KB);
}

/* Outputs of the tile's NQ heads: acc[g] = acc[g] corr[g] + the block's n V rows (vr) weighted by st[key][g], in
 * passes of TILE_PV heads (accumulate_v8: per key 2 loads of V and 6 broadcasts of weights for 12 FMAs). */
static inline __attribute__((always_inline)) void tile_values(float (*acc)[MAX_HD], const float (*st)[MAX_G],
                                                             const float *const *vr, int n, const float *corr,
                                                             int NQ, const int HD) {
    int g0 = 0;
    for (; g0 + TILE_PV <= NQ; g0 += TILE_PV)
        accumulate_v8(NULL, NULL, 0, vr, n, &st[0][g0], 1, MAX_G, corr + g0, acc + g0, HD, 0, TILE_PV);
    const float *w = &st[0][g0], *cg = corr + g0;
    switch (NQ - g0) {
    case 1: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 1); break;
    case 2: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 2); break;
    case 3: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 3); break;
    case 4: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 4); break;
    case 5: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 5); break;
    default: break;
    }
}

/* One work item: KV head h of tile t (a decode row: attend_dec8). */
static inline __attribute__((always_inline)) void attend_vec8(const Args *a, int t, int h, const int HD,
                                                              const int fmt) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    if (R == 1 && (fmt != 2 || DEC8_FP8) && a->G <= DEC_Q) { /* a decode row: an item of its KV heads, DEC_Q / G */
        const int per = a->item_heads == 1 ? 1 : DEC_Q / a->G;
        if (h % per == 0) attend_dec8(a, t, h, a->KVH - h < per ? a->KVH - h : per, HD, fmt);
        return; /* the other heads of its group: done with the first */
    }
    const int G = a->G, NQ = R * G, NHV = (NQ + 7) / 8;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    float qt[MAX_HD * MAX_G] __attribute__((aligned(32))); /* [dim][head] */
    float qlf[MAX_G] __attribute__((aligned(32)));
    tile_queries(a, t, h, HD, 8 * NHV, qt, qlf);
    __m256 qlen[TILE_HV], m[TILE_HV], l[TILE_HV];
    for (int v = 0; v < NHV; v++) {
        qlen[v] = _mm256_load_ps(qlf + 8 * v);
        m[v] = _mm256_set1_ps(-INFINITY);
        l[v] = _mm256_setzero_ps();
    }
    float acc[MAX_G][MAX_HD] __attribute__((aligned(32)));
    for (int g = 0; g < NQ; g++)
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    /* rows HD apart: at MAX_HD's 1 KB stride a block's rows fell into a quarter of a 32 KB L1's sets (0.81-0.86x
     * the time once packed) */
    float kb[BLOCK * MAX_HD] __attribute__((aligned(32)));
    float vb[BLOCK * MAX_HD] __attribute__((aligned(32)));
    float st[BLOCK][MAX_G] __attribute__((aligned(32)));
    float corr[MAX_G] __attribute__((aligned(32)));
    const float *kr[BLOCK + 8], *vr[BLOCK];
    float kmul[BLOCK], vmul[BLOCK];
    for (int j = BLOCK; j < BLOCK + 8; j++) kr[j] = zero_row;
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK];
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are widened */
        const int n_next = rows_after(a, t, h, 1, pages, t0, n, len, next, first, &pf, BLOCK);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->k, pf[j], HD, fmt);
            kr[j] = widen_row8(a->k, rows[j], kb + j * HD, HD, fmt);
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * a->scale;
        }
        for (int j = n; j < BLOCK; j++) kr[j] = zero_row;
        __m256 top[TILE_HV];
        for (int v = 0; v < NHV; v++) top[v] = _mm256_set1_ps(-INFINITY);
        switch (NHV) {
        case 1: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 1); break;
        case 2: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 2); break;
        case 3: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 3); break;
        default: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 4); break;
        }
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
            vr[j] = widen_row8(a->v, rows[j], vb + j * HD, HD, fmt);
            if (fmt == 2) vmul[j] = pow2i(a->ve[rows[j]]); /* the token's 2^e into its weights */
        }
        switch (NHV) {
        case 1: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 1); break;
        case 2: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 2); break;
        case 3: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 3); break;
        default: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 4); break;
        }
        tile_values(acc, (const float (*)[MAX_G])st, vr, n, corr, NQ, HD);
    }
    float lf[MAX_G] __attribute__((aligned(32)));
    for (int v = 0; v < NHV; v++) _mm256_store_ps(lf + 8 * v, l[v]);
    for (int g = 0; g < NQ; g++) store_out(a, d + g / G, h, g % G, acc[g], 1.0f / lf[g]);
}
#define SPECIALISE(hd, f) static void attend_##hd##_##f(const Args *a, int t, int h) { attend_vec8(a, t, h, hd, f); }
#else
#define SPECIALISE(hd, f) static void attend_##hd##_##f(const Args *a, int t, int h) { attend_hd(a, t, h, hd, f); }
#endif
/* ---- AMX tiles for decode rows over bf16 or fp8 pages (CPUs with AMX-TILE and AMX-BF16) ---------------------
 *
 * A decode row's G query heads (or a prompt tile's, up to 16) against its keys, both products on the tile unit,
 * SB keys at a time:
 *   scores S [16 tokens, 16 heads] = K [16 tokens, HD] . Q^T per block of 16 keys (one page's rows: pages hold a
 *     multiple of 16 tokens): the K rows are the first operand as they lie in the page (a row stride of
 *     KVH * HD), Q the second in its pair layout, heads past G zero (built once per item); HD / 32 `tdpbf16ps`,
 *     four blocks in flight;
 *   then the softmax over the SB keys at once: one running max and one rescale of O per SB keys, not per block;
 *     an item of few heads (a decode row) head by head, each head's scores gathered from the key rows
 *     (`softmax_heads`), one of many (a prompt tile's, from AMX_LANES_FROM) lane-wise over the key rows, the
 *     weights laid out by head by a transpose a block (`softmax_lanes`). The weights' e^x: 2^x by a degree-4
 *     polynomial (`exp2_weights16`), exact enough for the bfloat16 rounding they get next (measured worst error
 *     unchanged: 1.53u either way). SmolLM2's 512-row chunk after 512 keys, 30 layers: 73 -> 48 ms;
 *   O += P . V per block, V's rows again as they lie in the page: the second operand then pairs consecutive
 *     dims, not consecutive tokens, so P enters twice, its weights spread with a zero after each (summing the
 *     even dims) and before each (the odd ones): 2 HD / 32 products a block where interleaving pairs of V rows
 *     first (`vpermt2w`) took more time than the products it saved; O's tiles stay in tile registers over the
 *     SB keys (HD = 128: two sweeps), as 16 even then 16 odd dims per 32, put back in order at the end.
 * Every tile is 16 rows by 64 bytes, so one configuration per chunk of items serves both products.
 * Products exact, sums float32, as the vector copies' scores; what differs is P: the vector copies
 * multiply V by float32 weights, this one by their bfloat16 rounding (relative u = 2^-8 at most a weight, as
 * flash attention on GPUs rounds P to 16 bits), and the softmax's sum adds the rounded weights, so the output
 * is a weighted mean of V rows whose weights are off by at most 2u relative after normalising: with the
 * output's own rounding, within 3u of its magnitude (sum of |weight| |V|; measured up to ~1.5u on random
 * inputs), where the vector copy is within u; not of its value where V rows cancel.
 * Rows of a block past the context get no weight (their scores are not read, their V rows are zeros: a stale
 * page row may hold anything). fp8 pages: each block's K and V rows are first made their exact bfloat16 values in
 * L1 (`fp8x32_to_bf16`), the tokens' 2^e applied to scores and weights. Prompt tiles run as groups of at most 16 /
 * G rows, their query heads the columns of Q, each masked at its own row's keys. Float32 queries and fp32 pages
 * keep the vector copies. */
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"

#define AMX_G 16  /* query heads an item may hold here (a tile's 16 rows or columns) */
#define SB 128    /* keys per softmax step (a multiple of 32) */
/* Keys from which an item over bf16 pages runs here (over fp8 pages: every item). SmolLM2's shape (G = 3, HD = 64),
 * 32 rows x 30 layers' own pools, 2 threads, 2-core AMX Xeon VM, the two copies alternating: the tiles' time over
 * the vector copy's, bf16 pages 1.13x at 16 keys, 1.04-1.07x at 48-64, 0.98-1.00 at 128, 0.91 at 256, 0.85 at
 * 1,024; fp8 pages 0.88x at 16, 0.73 at 32, 0.62 at 64, 0.61 at 128, 0.54 at 1,024 (BENCHMARKS.md). */
#define AMX_MIN_KEYS 128
/* Tile registers (literals: the tile intrinsics paste them into the instruction). Scores: K (16 tokens x 32 dims,
 * two in turn) . Q (16 dim pairs x 16 heads, chunks c and c + 1) into four blocks' scores (16 tokens x 16 heads);
 * then outputs: the even- and odd-spread weights (16 heads x 16 tokens, spread)
 * . V (16 tokens x 32 dims as 16 dim pairs, two chunks in turn) into 16 heads x (16 even or odd dims) x 2 chunks */
#define T_K0 0
#define T_K1 6
#define T_Q0 1
#define T_Q1 7
#define T_S0 2
#define T_S1 3
#define T_S2 4
#define T_S3 5
#define T_PE 2
#define T_PO 3
#define T_V0 0
#define T_V1 1
#define T_O0 4
#define T_O1 5
#define T_O2 6
#define T_O3 7

static int amx_on = 1; /* paged_decode_set_amx */

/* Linux grants the tile state on request, once per process (as gemv_bf16.c's `gemv_bf16_amx_ready`). */
static int amx_granted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

static void amx_attention_config(void) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* The 16 x 16 matrix v[row] lane col, transposed in place (four rounds of shuffles, 64 in all). */
static inline void transpose16(__m512 v[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) { /* pairs of rows: lanes interleaved within each 128-bit lane */
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) /* pairs of pairs: 64-bit units */
        for (int k = 0; k < 2; k++) {
            const __m512d x = _mm512_castps_pd(t[i + k]), y = _mm512_castps_pd(t[i + k + 2]);
            v[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            v[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
    /* now v[4a + c] holds, in 128-bit lane L, rows 4a .. 4a+3 of column 4L + c; two rounds of 128-bit lane
     * shuffles (pairing v[a] with v[a + 4], then with v[a + 8]) gather each column's four pieces in order */
    for (int i = 0; i < 8; i++) {
        const int a = (i / 4) * 8 + i % 4;
        t[a] = _mm512_shuffle_f32x4(v[a], v[a + 4], 0x88);
        t[a + 4] = _mm512_shuffle_f32x4(v[a], v[a + 4], 0xdd);
    }
    for (int a = 0; a < 8; a++) {
        v[a] = _mm512_shuffle_f32x4(t[a], t[a + 8], 0x88);
        v[a + 8] = _mm512_shuffle_f32x4(t[a], t[a + 8], 0xdd);
    }
}

/* The keys after t0 + n of item (tile t, KV head h; len its keys), up to SB of them, else the next item's first
 * SB: the page row of each block of 16 (into rows); returns how many keys. The K and V rows they name are
 * prefetched into L2 while the current SB keys are computed (the pages lie anywhere: the hardware prefetchers do
 * not follow). Decode rows only: a prompt tile's groups read the same keys one after the other, in cache from
 * the first (prefetching them cost 7-10% of a 512-row chunk's time). */
static int amx_rows_after(const Args *a, int t, int h, int t0, int n, int len, int64_t *rows) {
    int d = tile_first(a, t);
    if (t0 + n >= len) { /* this item's last keys: the next item's first (the next KV head, or the next tile's) */
        if (h + 1 < a->KVH) h++;
        else if (t + 1 < a->ntiles) d = tile_first(a, t + 1), h = 0;
        else return 0;
        len = a->lens[d];
        t0 = 0;
    } else {
        t0 += n;
    }
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    const int m = len - t0 < SB ? len - t0 : SB;
    for (int b = 0; 16 * b < m; b++) rows[b] = (pages[(t0 + 16 * b) / a->S] * a->S + (t0 + 16 * b) % a->S) * a->KVH + h;
    return m;
}

/* The weights of the current SB keys as the P . V products' first operands: for block b and query head q, the 16
 * tokens' bfloat16 weights with a zero after each (`even`) or before each (`odd`), so that against 16 V rows as
 * they lie in the page (pairs of consecutive dims) one product sums the even dims and the other the odd ones.
 * Per thread. Rows past the item's NQ heads hold whatever an earlier item left: a product's output row reads
 * only its own first-operand row, so they reach only output rows that are never stored. */
static __thread uint16_t amx_even[SB / 16][AMX_G][32] __attribute__((aligned(64)));
static __thread uint16_t amx_odd[SB / 16][AMX_G][32] __attribute__((aligned(64)));
/* output sums between steps (rows past NQ likewise): chunk c of 32 dims as its 16 even dims, then its 16 odd */
static __thread float amx_out[AMX_G][MAX_HD] __attribute__((aligned(64)));

static void attend_64_1(const Args *a, int t, int h);
static void attend_128_1(const Args *a, int t, int h);

/* fp8 pages: the n page rows of a block (from page row `row`, KV head stride KVH) as their exact bfloat16 values
 * into dst [16][HD] (rows past n zero), and each token's 2^e into mul[16] (e from exps). By table where the CPU
 * has AVX512-VBMI (`fp8_row_to_bf16`): SmolLM2's decode rows over FP8 pages, 32 x 512 keys, 0.91-0.92x the
 * time of the conversion by bits, alternating in one process; 4 x 1,024 keys 0.90-0.97x; G = 8, HD = 128 0.97x. */
static inline __attribute__((always_inline)) void fp8_block(const uint8_t *base, const int8_t *exps, int64_t row,
                                                            int n, int KVH, int HD, uint16_t (*dst)[MAX_HD],
                                                            float *mul) {
    for (int j = 0; j < 16; j++) {
        if (j < n) {
            const int64_t r = row + (int64_t)j * KVH;
            fp8_row_to_bf16(base + r * HD, dst[j], HD);
            mul[j] = pow2i(exps[r]);
        } else {
            for (int c = 0; c < HD; c += 32) _mm512_store_si512(&dst[j][c], _mm512_setzero_si512());
            mul[j] = 0.0f;
        }
    }
}

/* Query heads of an item from which its softmax runs lane-wise (`softmax_lanes`), not head by head. */
#define AMX_LANES_FROM 9

/* Rescales head g's output sums by c[g] where that is not 1 (the running maximum moved). */
static inline __attribute__((always_inline)) void rescale_out(float (*o)[MAX_HD], const float *c, int NQ, int HD) {
    for (int g = 0; g < NQ; g++)
        if (c[g] != 1.0f)
            for (int i = 0; i < HD; i += 16)
                _mm512_store_ps(&o[g][i], _mm512_mul_ps(_mm512_load_ps(&o[g][i]), _mm512_set1_ps(c[g])));
}

/* The softmax step over the n keys of sc (scores: key, head) for query head g < NQ (seeing qlen[g] keys):
 * running max m and sum l, the output sums o rescaled, and the weights (bfloat16, V's 2^e applied for fp8) into
 * amx_even / amx_odd. Head by head: each head's scores gathered out of the key rows, 16 keys a gather. */
static inline __attribute__((always_inline)) void softmax_heads(float (*sc)[16], int n, int blocks, int t0,
                                                                const int *qlen, int NQ, int HD, float scale,
                                                                const int fp8, const float *kmul, const float *vmul,
                                                                float *m, float *l, float (*o)[MAX_HD]) {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    float corr[AMX_G];
    for (int g = 0; g < NQ; g++) {
        __m512 s[SB / 16];
        __m512 top = _mm512_set1_ps(-INFINITY);
        const int ng = qlen[g] - t0 < n ? qlen[g] - t0 : n; /* may be <= 0: a row whose keys ended */
        for (int b = 0; b < blocks; b++) {
            const int left = ng - 16 * b;
            const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            s[b] = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_set1_ps(-INFINITY), live,
                                                           _mm512_add_epi32(column, _mm512_set1_epi32(g)),
                                                           sc[16 * b], 4),
                                 _mm512_set1_ps(scale));
            if (fp8) s[b] = _mm512_mask_mul_ps(s[b], live, s[b], _mm512_loadu_ps(kmul + 16 * b));
            top = _mm512_max_ps(top, s[b]);
        }
        const float bm = fmaxf(m[g], _mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++) {
            const __mmask16 seen = _mm512_cmp_ps_mask(s[b], _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ); /* NaN too */
            const __m512 x = _mm512_mul_ps(_mm512_sub_ps(s[b], _mm512_set1_ps(bm)), _mm512_set1_ps(LOG2E));
            __m512 w = round_bf16_hi(_mm512_maskz_mov_ps(seen, exp2_weights16(x)));
            sum = _mm512_add_ps(sum, w); /* the weights as rounded */
            if (fp8) w = round_bf16_hi(_mm512_mul_ps(w, _mm512_loadu_ps(vmul + 16 * b))); /* exact: 2^e */
            _mm512_store_si512(amx_odd[b][g], _mm512_castps_si512(w));
            _mm512_store_si512(amx_even[b][g], _mm512_srli_epi32(_mm512_castps_si512(w), 16));
        }
        corr[g] = expf(m[g] - bm); /* 0 at the first step */
        l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(sum);
        m[g] = bm;
    }
    rescale_out(o, corr, NQ, HD);
}

/* softmax_heads' step for every query head at once: a key's score row holds the heads in its lanes, so the
 * running maxima, sums and weights are lane-wise (lanes past NQ see no key: weight 0), and one 16 x 16
 * transpose a block lays the weights out by head. Fewer instructions where many heads share the keys (a prompt
 * tile's rows); a decode row's few heads would leave most lanes idle. */
static inline __attribute__((always_inline)) void softmax_lanes(float (*sc)[16], int n, int blocks, int t0,
                                                                const int *qlen, int NQ, int HD, float scale,
                                                                const int fp8, const float *kmul, const float *vmul,
                                                                float *m, float *l, float (*o)[MAX_HD]) {
    const __m512i seen = _mm512_loadu_si512(qlen);
    const __m512 vscale = _mm512_set1_ps(scale), mv = _mm512_load_ps(m);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j++) {
        const __m512 sj = fp8 ? _mm512_mul_ps(_mm512_load_ps(sc[j]), _mm512_set1_ps(kmul[j])) : _mm512_load_ps(sc[j]);
        top = _mm512_mask_max_ps(top, _mm512_cmpgt_epi32_mask(seen, _mm512_set1_epi32(t0 + j)), top, sj);
    }
    const __m512 bm = _mm512_max_ps(mv, _mm512_mul_ps(top, vscale)); /* NaN where a head's scores are */
    const __m512 vscale2 = _mm512_mul_ps(vscale, _mm512_set1_ps(LOG2E)), bm2 = _mm512_mul_ps(bm, _mm512_set1_ps(LOG2E));
    __m512 sum = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512 w[16];
        for (int i = 0; i < 16; i++) {
            const int j = 16 * b + i;
            if (j >= n) {
                w[i] = _mm512_setzero_ps();
                continue;
            }
            const __m512 sj = fp8 ? _mm512_mul_ps(_mm512_load_ps(sc[j]), _mm512_set1_ps(kmul[j]))
                                  : _mm512_load_ps(sc[j]);
            const __mmask16 live = _mm512_cmpgt_epi32_mask(seen, _mm512_set1_epi32(t0 + j));
            w[i] = round_bf16_hi(_mm512_maskz_mov_ps(live, exp2_weights16(_mm512_fmsub_ps(sj, vscale2, bm2))));
            sum = _mm512_add_ps(sum, w[i]); /* the weights as rounded */
            if (fp8) w[i] = round_bf16_hi(_mm512_mul_ps(w[i], _mm512_set1_ps(vmul[j]))); /* exact: 2^e */
        }
        transpose16(w); /* w[g]: head g's 16 weights */
        for (int g = 0; g < NQ; g++) {
            _mm512_store_si512(amx_odd[b][g], _mm512_castps_si512(w[g]));
            _mm512_store_si512(amx_even[b][g], _mm512_srli_epi32(_mm512_castps_si512(w[g]), 16));
        }
    }
    const __m512 corr = exp_nonpositive16(_mm512_sub_ps(mv, bm)); /* 0 at the first step */
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), corr, sum));
    _mm512_store_ps(m, bm);
    float c[AMX_G] __attribute__((aligned(64)));
    _mm512_store_ps(c, corr);
    rescale_out(o, c, NQ, HD);
}

/* Rows d .. d+R-1 of tile t (R G <= 16 query heads) against KV head h, bf16 q and bf16 pages, or fp8 pages
 * (`fp8`: each block's K and V rows made their exact bfloat16 values in L1 first, `fp8_block`; the token's 2^e
 * of K into its scores, of V into its weights after the softmax's sum, as the vector copy applies them). Query
 * head q (row q / G) sees its row's keys: a prompt chunk's causal diagonal is a per-head mask of the scores. */
static inline __attribute__((always_inline)) void amx_rows(const Args *a, int t, int h, int d, int R,
                                                           const int fp8) {
    const int G = a->G, HD = a->HD, S = a->S, KVH = a->KVH, NQ = R * G, len = a->lens[d + R - 1];
    const int64_t stride = (int64_t)KVH * HD; /* elements from one token's row of head h to the next's */
    int qlen[AMX_G] = {0}; /* keys query head q sees: its row's */
    for (int q = 0; q < NQ; q++) qlen[q] = a->lens[d + q / G];
    const uint16_t *kp = (const uint16_t *)a->k, *vp = (const uint16_t *)a->v;
    const uint8_t *k8 = (const uint8_t *)a->k, *v8 = (const uint8_t *)a->v;
    uint16_t kb[fp8 ? SB : 1][MAX_HD] __attribute__((aligned(64))); /* fp8: the SB keys' K rows as bf16 */
    uint16_t vb[fp8 ? SB : 1][MAX_HD] __attribute__((aligned(64))); /* and V's, zeros past the context */
    float kmul[SB], vmul[SB];
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    uint16_t qv[MAX_HD / 32][16][AMX_G][2] __attribute__((aligned(64))); /* dims 32c + 2r + e of head g */
    float sc[SB][16] __attribute__((aligned(64)));                      /* scores: token, head */
    uint16_t tail[16][MAX_HD] __attribute__((aligned(64)));             /* a last block's V rows, zeros after */
    float(*o)[MAX_HD] = amx_out;
    float m[AMX_G] __attribute__((aligned(64))), l[AMX_G] __attribute__((aligned(64))); /* running max, sum */
    memset(qv, 0, sizeof(qv[0]) * (HD / 32));
    for (int q = 0; q < NQ; q++) { /* query head q: row q / G's head q % G */
        const uint16_t *qs = (const uint16_t *)a->q + (((int64_t)(d + q / G) * KVH + h) * G + q % G) * HD;
        for (int c = 0; c < HD / 32; c++)
            for (int r = 0; r < 16; r++) qv[c][r][q][0] = qs[32 * c + 2 * r], qv[c][r][q][1] = qs[32 * c + 2 * r + 1];
    }
    for (int q = 0; q < AMX_G; q++) m[q] = -INFINITY, l[q] = 0.0f;
    for (int q = 0; q < NQ; q++) memset(o[q], 0, sizeof(float) * HD);
    for (int t0 = 0; t0 < len; t0 += SB) {
        const int n = len - t0 < SB ? len - t0 : SB, blocks = (n + 15) / 16;
        int64_t rows[SB / 16], ahead[SB / 16]; /* page row of each block's first token; of the next SB keys' */
        for (int b = 0; b < blocks; b++) rows[b] = (pages[(t0 + 16 * b) / S] * S + (t0 + 16 * b) % S) * KVH + h;
        const int m_ahead = R == 1 ? amx_rows_after(a, t, h, t0, n, len, ahead) : 0;
        for (int j = 0; j < m_ahead; j++) { /* the next keys' K and V rows, into L2 while these run */
            prefetch_row(a->k, ahead[j / 16] + (j % 16) * KVH, HD, fp8 ? 2 : 1);
            prefetch_row(a->v, ahead[j / 16] + (j % 16) * KVH, HD, fp8 ? 2 : 1);
        }
        if (fp8)
            for (int b = 0; b < blocks; b++) {
                const int nb = n - 16 * b < 16 ? n - 16 * b : 16;
                fp8_block(k8, a->ke, rows[b], nb, KVH, HD, kb + 16 * b, kmul + 16 * b);
                fp8_block(v8, a->ve, rows[b], nb, KVH, HD, vb + 16 * b, vmul + 16 * b);
            }
        /* K rows of block b and their stride: in the page, or converted */
        const uint16_t *kblock[SB / 16];
        for (int b = 0; b < blocks; b++) kblock[b] = fp8 ? kb[16 * b] : kp + rows[b] * HD;
        const int64_t kstride = fp8 ? 2 * MAX_HD : 2 * stride;
        /* scores, four blocks of 16 keys at a time: four accumulators, two K tiles in turn and two Q tiles (chunks
         * c and c + 1), so a tile is not reloaded while the product before still reads it */
        for (int b0 = 0; b0 < blocks; b0 += 4) {
            _tile_zero(T_S0);
            _tile_zero(T_S1);
            _tile_zero(T_S2);
            _tile_zero(T_S3);
            for (int c = 0; c < HD / 32; c += 2) {
                _tile_loadd(T_Q0, qv[c], sizeof(qv[0][0]));
                _tile_loadd(T_Q1, qv[c + 1], sizeof(qv[0][0]));
#define QK(ST, KT, QT, i, cc)                                                       \
    if (b0 + (i) < blocks) {                                                       \
        _tile_loadd(KT, kblock[b0 + (i)] + 32 * (cc), kstride);                    \
        _tile_dpbf16ps(ST, KT, QT);                                                \
    }
                QK(T_S0, T_K0, T_Q0, 0, c) QK(T_S1, T_K1, T_Q0, 1, c) QK(T_S2, T_K0, T_Q0, 2, c)
                QK(T_S3, T_K1, T_Q0, 3, c)
                QK(T_S0, T_K0, T_Q1, 0, c + 1) QK(T_S1, T_K1, T_Q1, 1, c + 1) QK(T_S2, T_K0, T_Q1, 2, c + 1)
                QK(T_S3, T_K1, T_Q1, 3, c + 1)
#undef QK
            }
            _tile_stored(T_S0, sc[16 * b0], 64);
            if (b0 + 1 < blocks) _tile_stored(T_S1, sc[16 * b0 + 16], 64);
            if (b0 + 2 < blocks) _tile_stored(T_S2, sc[16 * b0 + 32], 64);
            if (b0 + 3 < blocks) _tile_stored(T_S3, sc[16 * b0 + 48], 64);
        }
        if (NQ >= AMX_LANES_FROM)
            softmax_lanes(sc, n, blocks, t0, qlen, NQ, HD, a->scale, fp8, kmul, vmul, m, l, o);
        else
            softmax_heads(sc, n, blocks, t0, qlen, NQ, HD, a->scale, fp8, kmul, vmul, m, l, o);
        const int partial = fp8 ? 0 : n % 16; /* a last block past the context: its rows copied, zeros after (stale
                                               * rows may hold anything, and 0 x NaN is NaN; fp8_block did it) */
        if (partial) {
            for (int j = 0; j < 16; j++) {
                if (j < partial) memcpy(tail[j], vp + (rows[blocks - 1] + (int64_t)j * KVH) * HD, 2 * HD);
                else memset(tail[j], 0, 2 * HD);
            }
        }
        for (int c0 = 0; c0 < HD / 32; c0 += 2) { /* O += P . V, 64 dims a sweep: 2 chunks, even and odd dims */
            _tile_loadd(T_O0, &o[0][32 * c0], sizeof(o[0]));
            _tile_loadd(T_O1, &o[0][32 * c0 + 16], sizeof(o[0]));
            _tile_loadd(T_O2, &o[0][32 * c0 + 32], sizeof(o[0]));
            _tile_loadd(T_O3, &o[0][32 * c0 + 48], sizeof(o[0]));
            for (int b = 0; b < blocks; b++) {
                const int last = partial && b == blocks - 1;
                const uint16_t *v0 = fp8 ? vb[16 * b] : last ? &tail[0][0] : vp + rows[b] * HD;
                const int64_t vs = fp8 || last ? 2 * MAX_HD : 2 * stride;
                _tile_loadd(T_PE, amx_even[b], 64);
                _tile_loadd(T_PO, amx_odd[b], 64);
                _tile_loadd(T_V0, v0 + 32 * c0, vs);
                _tile_loadd(T_V1, v0 + 32 * c0 + 32, vs);
                _tile_dpbf16ps(T_O0, T_PE, T_V0);
                _tile_dpbf16ps(T_O1, T_PO, T_V0);
                _tile_dpbf16ps(T_O2, T_PE, T_V1);
                _tile_dpbf16ps(T_O3, T_PO, T_V1);
            }
            _tile_stored(T_O0, &o[0][32 * c0], sizeof(o[0]));
            _tile_stored(T_O1, &o[0][32 * c0 + 16], sizeof(o[0]));
            _tile_stored(T_O2, &o[0][32 * c0 + 32], sizeof(o[0]));
            _tile_stored(T_O3, &o[0][32 * c0 + 48], sizeof(o[0]));
        }
    }
    for (int q = 0; q < NQ; q++) { /* even and odd dims back in order */
        float row[MAX_HD];
        for (int c = 0; c < HD / 32; c++)
            for (int i = 0; i < 16; i++)
                row[32 * c + 2 * i] = o[q][32 * c + i], row[32 * c + 2 * i + 1] = o[q][32 * c + 16 + i];
        store_out(a, d + q / G, h, q % G, row, 1.0f / l[q]);
    }
}

/* One work item: KV head h of tile t (a decode row, or a prompt chunk's rows in groups of 16 / G at most). Over
 * bf16 pages a decode row of fewer than AMX_MIN_KEYS keys takes the vector copy. A decode row takes the same path
 * alone or in a call with prompt tiles (a unified worker's step and the fused decode layers' two calls for it
 * give the same bits). */
static inline __attribute__((always_inline)) void attend_amx_fmt(const Args *a, int t, int h, const int fp8) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d, per = AMX_G / a->G;
    if (R == 1 && !fp8 && a->lens[d] < AMX_MIN_KEYS) {
        (a->HD == 64 ? attend_64_1 : attend_128_1)(a, t, h);
        return;
    }
    for (int i = 0; i < R; i += per) amx_rows(a, t, h, d + i, R - i < per ? R - i : per, fp8);
}
static void attend_amx(const Args *a, int t, int h) { attend_amx_fmt(a, t, h, 0); }
static void attend_amx_fp8(const Args *a, int t, int h) { attend_amx_fmt(a, t, h, 1); }
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
