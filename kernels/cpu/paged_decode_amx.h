/* paged_decode.c's AMX tiles for decode rows over bf16 or fp8 pages, on CPUs with AMX-TILE and AMX-BF16 (included
 * by paged_decode.c after the vector copies, whose helpers it takes: paged_decode_avx512.h, paged_decode_pairs.h).
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

/* x rounded to bfloat16 (nearest even), as float32: the bfloat16 bits in each lane's top half, zeros below. */
static inline __m512 round_bf16_hi(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
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
