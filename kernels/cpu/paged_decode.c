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
 * 2^(e-127) (1 + m/8) for e > 0 and 2^-126 (m/8) for e = 0; the true values are 2^(e-7) (1 + m/8)
 * and 2^-6 (m/8): both off by exactly 2^120, which is folded into the row's scale with the token's
 * own 2^e (applied as two exact multiplies: 2^120 * 2^e may not fit one float). bf16 -> fp32 is the
 * 16-bit shift. Sums are over HD in float32 (the compiler may reassociate them to vectorise: the
 * order of a 64-term sum, not the result's precision, changes).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32 /* tokens per softmax block */
#define MAX_HD 256
#define MAX_G 32

typedef struct {
    const float *q;
    const void *k, *v;
    const int8_t *ke, *ve;
    const int64_t *table;
    const int32_t *lens;
    float *out;
    int D, KVH, G, HD, S, MAXP, fmt;
    float scale;
    int begin, end; /* work items: (sequence, KV head) pairs */
} Args;

static inline float as_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* e^x for finite x <= 0, branch-free so the softmax loops vectorise (glibc's expf is a call per element):
 * x = n ln2 + r with n = rint(x / ln2) and r from two exact-ish fused steps (Cody-Waite: ln2 split in a
 * high part with trailing zeros and a low part), |r| <= ln2 / 2; e^r by its Taylor polynomial to r^7
 * (truncation < 2e-8 relative); times 2^n from the exponent bits. Below -87 (where 2^n would leave the
 * normal range) the result is 0, as e^x < 1.7e-38 is against a running sum >= 1. Within 2 ulp of expf. */
static inline float exp_nonpositive(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float n = rintf(xc * 1.44269504088896341f);
    float r = fmaf(n, -0.693145751953125f, xc); /* ln2's high 16 bits: n * hi is exact */
    r = fmaf(n, -1.42860682030941723e-06f, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const float scale = as_float((uint32_t)((int32_t)n + 127) << 23);
    return x < -87.0f ? 0.0f : p * scale;
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
        for (int i = 0; i < HD; i++) dst[i] = as_float((uint32_t)src[i] << 16);
        *mul = 1.0f;
    } else {
        const uint8_t *src = (const uint8_t *)base + row * HD;
        const float fix = 0x1p120f;
        for (int i = 0; i < HD; i++) {
            uint32_t x = src[i];
            dst[i] = as_float(((x & 0x80u) << 24) | ((x & 0x7Fu) << 20)) * fix;
        }
        *mul = ldexpf(1.0f, exps[row]);
    }
}

/* HD and fmt are arguments so that `attend_*` below get copies specialised for the common head sizes and
 * formats: with them known at compile time the HD loops are whole vectors with no remainder. */
static inline __attribute__((always_inline)) void attend_hd(const Args *a, int d, int h, const int HD,
                                                            const int fmt) {
    const int G = a->G, S = a->S, KVH = a->KVH;
    const int len = a->lens[d];
    const float *q = a->q + ((int64_t)d * KVH + h) * G * HD;
    float *out = a->out + ((int64_t)d * KVH + h) * G * HD;
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
        for (int j = 0, p = t0 / S, o = t0 % S; j < n; j++) {
            rows[j] = (pages[p] * S + o) * KVH + h;
            if (++o == S) {
                o = 0;
                p++;
            }
        }
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
            const float corr = expf(m[g] - bm); /* 0 on the first block (m = -inf) */
            l[g] *= corr;
            for (int i = 0; i < HD; i++) acc[g][i] *= corr;
            for (int j = 0; j < n; j++) s[g][j] = exp_nonpositive(s[g][j] - bm);
            for (int j = 0; j < n; j++) l[g] += s[g][j];
            m[g] = bm;
        }
        for (int j = 0; j < n; j++) {
            load_row(a, a->v, a->ve, rows[j], row, &vmul[j], HD, fmt);
            for (int g = 0; g < G; g++) {
                const float p = s[g][j] * vmul[j];
                for (int i = 0; i < HD; i++) acc[g][i] += p * row[i];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float inv = 1.0f / l[g];
        for (int i = 0; i < HD; i++) out[g * HD + i] = acc[g][i] * inv;
    }
}

#define SPECIALISE(hd, f) static void attend_##hd##_##f(const Args *a, int d, int h) { attend_hd(a, d, h, hd, f); }
SPECIALISE(64, 0) SPECIALISE(64, 1) SPECIALISE(64, 2) SPECIALISE(128, 0) SPECIALISE(128, 1) SPECIALISE(128, 2)
static void attend_any(const Args *a, int d, int h) { attend_hd(a, d, h, a->HD, a->fmt); }

static void *run(void *p) {
    const Args *a = (const Args *)p;
    void (*attend)(const Args *, int, int) = attend_any;
    if (a->HD == 64) attend = a->fmt == 0 ? attend_64_0 : a->fmt == 1 ? attend_64_1 : attend_64_2;
    if (a->HD == 128) attend = a->fmt == 0 ? attend_128_0 : a->fmt == 1 ? attend_128_1 : attend_128_2;
    for (int w = a->begin; w < a->end; w++) attend(a, w / a->KVH, w % a->KVH);
    return NULL;
}

/* Returns 0, or -1 for shapes beyond the fixed buffers (the caller falls back). */
int paged_decode(const float *q, const void *k, const void *v, const int8_t *ke, const int8_t *ve,
                 const int64_t *table, const int32_t *lens, float *out, int D, int KVH, int G, int HD, int S,
                 int MAXP, int fmt, float scale, int threads) {
    if (HD > MAX_HD || G > MAX_G || HD <= 0 || G <= 0) return -1;
    const int items = D * KVH;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
    Args args[64];
    pthread_t tid[64];
    if (threads > 64) threads = 64;
    for (int i = 0; i < threads; i++) {
        args[i] = (Args){q, k, v, ke, ve, table, lens, out, D, KVH, G, HD, S, MAXP, fmt, scale,
                         items * i / threads, items * (i + 1) / threads};
    }
    int started = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tid[i], NULL, run, &args[i]) != 0) break;
        started = i;
    }
    for (int i = started + 1; i < threads; i++) run(&args[i]); /* threads that could not start */
    run(&args[0]);
    for (int i = 1; i <= started; i++) pthread_join(tid[i], NULL);
    return 0;
}
