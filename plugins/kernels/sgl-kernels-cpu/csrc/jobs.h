/* The parts of the kernels that are the same at every instruction-set level: the job each
 * kernel shares out over the pool's threads, the checks of its arguments, and the set-up before
 * the vector code. Each level's file (kernels_avx512.c, kernels_avx2.c) passes its own range
 * function to run_X, which checks, builds the job and runs it on the pool; the codes returned
 * are those of the kernels (0; -1: arguments refused; -2: out of memory). */
#ifndef SGL_JOBS_H
#define SGL_JOBS_H

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#include <xmmintrin.h>

/* -- prefetching into L2 ---------------------------------------------------------------------
 * A decode step reads every weight and every cached K and V row from memory once, so the
 * kernels ask for them ahead, in small shares spread over their work rather than in bursts (a
 * burst overran the core's miss buffers; docs/benchmarks.md, "Decode attention from memory" and
 * "Matmul weights from memory"). */

/* tokens the decode attention's QK pass prefetches ahead */
#define KV_PREFETCH_AHEAD 32

/* always inlined: a call in the kernels' inner loops would spill their vector sums */
#define PREFETCH_INLINE static inline __attribute__((always_inline))

PREFETCH_INLINE void prefetch_l2(const char *p, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
}

/* The share of group g (of `groups` groups of rows) of the next 32-column bfloat16 panel
   (`next`, [KB][32 lines]; NULL: none): the first line of the share in each K block, NULL when
   the group has none, and its number of lines in *lines. */
PREFETCH_INLINE const char *next_panel_share(const char *next, int64_t groups, int64_t g,
                                            int64_t *lines) {
    const int64_t per_group = (32 + groups - 1) / groups;
    if (!next || g * per_group >= 32) {
        *lines = 0;
        return NULL;
    }
    *lines = g * per_group + per_group <= 32 ? per_group : 32 - g * per_group;
    return next + g * per_group * 64;
}

/* at step p (0..15) of K block kb, the lines of the share that step prefetches */
PREFETCH_INLINE void prefetch_panel_share(const char *share, int64_t lines, int64_t kb, int p) {
    if (p < lines) _mm_prefetch(share + kb * 2048 + p * 64, _MM_HINT_T1);
    if (p + 16 < lines) _mm_prefetch(share + kb * 2048 + (p + 16) * 64, _MM_HINT_T1);
}

/* chunks per thread of the decode attention, the rows of x the quantized matmuls round and
   the AVX2 quantized matmuls (no prefetch from one claim's columns to the next): about a
   quarter of a thread's share, so that a thread the OS delays costs no more than that */
static inline int64_t chunk_of(int64_t n) {
    const int threads = sgl_pool_threads();
    return sgl_balanced_chunk(n, n / (4 * (int64_t)threads), threads);
}

/* column panels per claim of the bfloat16 and float32 matmuls: a few, so that a thread the OS
   delays holds up at most a few panels (the pool's other threads take over the rest of its
   share). A thread claims its share's panels in order and each panel's rows prefetch the next
   panel, the first of its next claim too, so a claim does not begin on a cold panel: with four
   claims per thread dealt out round-robin each did, and a batch-32 decode step's matmuls took
   19.4 ms on two Zen 4 cores against 17.3 ms with one claim per thread (docs/benchmarks.md,
   "Where concurrency 32 goes"). */
static inline int64_t panel_chunk(int64_t n) {
    const int threads = sgl_pool_threads();
    const int64_t chunk = n / (4 * (int64_t)threads);
    return sgl_balanced_chunk(n, chunk > 4 ? 4 : chunk, threads);
}

/* column panels per claim of the quantized matmuls, whose prefetch stops at the end of a
   claim: one claim per thread's share */
static inline int64_t panels_per_thread(int64_t n) {
    const int64_t t = sgl_pool_threads();
    return (n + t - 1) / t;
}

/* -- float32 linear (columns in 32-wide panels) ------------------------------------------- */

typedef struct {
    const float *x, *wp, *bias;
    float *y;
    int64_t ldx, ldy, M, N, K;
} linear_f32_job;

static inline int run_linear_f32(sgl_range_fn panels, const float *x, int64_t ldx,
                                 const float *wp, float *y, int64_t ldy, int64_t M, int64_t N,
                                 int64_t K, const float *bias) {
    const int64_t NP = (N + 31) / 32;
    linear_f32_job job = {x, wp, bias, y, ldx, ldy, M, N, K};
    sgl_parallel_for(panels, &job, NP, panel_chunk(NP));
    return 0;
}

/* -- RMSNorm, SiLU x up, rotary (rows) ------------------------------------------------------ */

typedef struct {
    const void *x, *residual, *weight;
    void *res_out, *out;
    int64_t x_stride, r_stride, ro_stride, o_stride, H, heads;
    float eps;
    int dtype;
    atomic_int failed;
} rmsnorm_job;

static inline int run_rmsnorm(sgl_range_fn rows_fn, const void *x, int64_t x_stride,
                              const void *residual, int64_t r_stride, void *res_out,
                              int64_t ro_stride, const void *weight, void *out, int64_t o_stride,
                              int64_t T, int64_t H, int64_t heads, float eps, int dtype) {
    if (heads < 1 || (heads > 1 && residual)) return -1;
    rmsnorm_job job = {x, residual, weight, res_out, out, x_stride, r_stride, ro_stride, o_stride,
                       H, heads, eps, dtype, 0};
    sgl_parallel_for(rows_fn, &job, T, sgl_row_chunk(T));
    return atomic_load(&job.failed) ? -2 : 0;
}

typedef struct {
    const void *x;
    void *out;
    int64_t x_stride, o_stride, d;
    int dtype;
} silu_mul_job;

static inline int run_silu_mul(sgl_range_fn rows_fn, const void *x, int64_t x_stride, void *out,
                               int64_t o_stride, int64_t T, int64_t d, int dtype) {
    silu_mul_job job = {x, out, x_stride, o_stride, d, dtype};
    sgl_parallel_for(rows_fn, &job, T, sgl_row_chunk(T));
    return 0;
}

typedef struct {
    const void *x, *cs;
    const int64_t *pos;
    void *out;
    int64_t x_stride, cs_stride, H, D, rot;
    int dtype;
} rotary_job;

static inline int run_rotary(sgl_range_fn rows_fn, const void *x, int64_t x_stride,
                             const void *cs, int64_t cs_stride, const int64_t *pos,
                             int64_t cs_rows, void *out, int64_t T, int64_t H, int64_t D,
                             int64_t rot, int dtype) {
    if (rot % 2 || rot > D) return -1;
    if (pos)
        for (int64_t t = 0; t < T; t++)
            if (pos[t] < 0 || pos[t] >= cs_rows) return -2;
    rotary_job job = {x, cs, pos, out, x_stride, cs_stride, H, D, rot, dtype};
    sgl_parallel_for(rows_fn, &job, T, sgl_row_chunk(T));
    return 0;
}

/* -- paged decode attention (sequences) ------------------------------------------------------ */

#define MAX_HEADS 256

typedef struct {
    const void *q;
    int64_t q_stride_t, q_stride_h;
    char *kp, *vp;
    int64_t k_row, v_row;
    const int64_t *table, *rows, *lens;
    int64_t table_stride;
    void *out;
    int64_t out_stride_t, B, Hq, Hk, D, Dv, window, es;
    float scale, softcap;
    int dtype, bf16_dot;
    atomic_int failed;
} attention_job;

/* The first key of sequence b (the window keeps its last `window` keys), and its count. */
static inline int64_t decode_window_start(const attention_job *j, int64_t b, int64_t *n) {
    const int64_t len = j->lens[b];
    const int64_t start = j->window > 0 && len > j->window ? len - j->window : 0;
    *n = len - start;
    return start;
}

/* Writes the new tokens' K/V into the pools first (when k_new is given). */
static inline int run_decode_attention(
    sgl_range_fn items_fn, const void *q, int64_t q_stride_t, int64_t q_stride_h,
    const void *k_new, int64_t k_new_stride, const void *v_new, int64_t v_new_stride,
    void *k_pool, void *v_pool, const int64_t *table, int64_t table_stride, const int64_t *rows,
    const int64_t *lens, const int64_t *loc, void *out, int64_t out_stride_t, int64_t B,
    int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, float scale, float softcap, int64_t window,
    int dtype, int bf16_dot) {
    if (D % 16 || Dv % 16 || D < 16 || Dv < 16 || D > 256 || Dv > 256 || Hk < 1 || Hq > MAX_HEADS
        || (Hq / Hk) * Hk != Hq) return -1;
    const int64_t es = dtype ? 2 : 4;
    char *kp = (char *)k_pool, *vp = (char *)v_pool;
    const int64_t k_row = Hk * D * es, v_row = Hk * Dv * es;
    if (k_new)
        for (int64_t b = 0; b < B; b++) {
            memcpy(kp + loc[b] * k_row, (const char *)k_new + b * k_new_stride * es, (size_t)k_row);
            memcpy(vp + loc[b] * v_row, (const char *)v_new + b * v_new_stride * es, (size_t)v_row);
        }
    attention_job job = {q, q_stride_t, q_stride_h, kp, vp, k_row, v_row, table, rows, lens,
                         table_stride, out, out_stride_t, B, Hq, Hk, D, Dv, window, es,
                         scale, softcap, dtype, bf16_dot, 0};
    sgl_parallel_for(items_fn, &job, B * Hk, chunk_of(B * Hk)); /* item: a sequence, a KV head */
    return atomic_load(&job.failed) ? -2 : 0;
}

/* -- paged extend attention (tiles of query tokens x KV heads) ------------------------------- */

#define EXT_KB 64   /* keys per block */
#define EXT_ROWS 64 /* query rows per item, at most */

/* -- the decode kernels' buffers (they walk the extend kernels' blocks) ----------------------- */

/* floats per query row of the decode kernels' scores: a block of keys and a group's padding */
#define DEC_SLD (EXT_KB + 32)

/* A thread's buffers of the decode kernels: a group of keys' K rows transposed (kt
   [D][keys]), outputs o [G][Dv], scores s [G][DEC_SLD], queries qs [G][D] (scaled float32, or
   bfloat16 pairs), and per query row its running maximum, sum and factor. */
/* A thread's read-ahead over the keys of its items (in order): the K and V rows of the keys up
   to DEC_AHEAD_BYTES past those being multiplied are asked into L2, into the next items too.
   Decode attention is latency-bound without it: each item reads one KV head's row (128 bytes
   at head_dim 64) from each of its keys' slots, scattered over the pool. */
typedef struct {
    int64_t item, key, end; /* the next key to ask for: of item `item` (< end) */
} dec_ahead;

typedef struct {
    float *qs, *o, *s, *kt, *m, *l, *alpha;
    dec_ahead *ahead;
} dec_buffers;

/* The decode kernels' walk of sequence b's keys for KV head hk (all levels): the block after
   k0 ends at the next multiple of EXT_KB or at the sequence's end n (*k1); kr and vr get the
   block's K and V rows (asked into L2 ahead of time by dec_ahead_advance). The first block begins
   at the window's first key rounded down to even: the extend kernels' pairs and blocks. */
static inline int64_t dec_block(const attention_job *j, const int64_t *slots, int64_t hk,
                                int64_t k0, int64_t n, const char **kr, const char **vr,
                                int64_t *k1) {
    const int64_t end = (k0 / EXT_KB + 1) * EXT_KB < n ? (k0 / EXT_KB + 1) * EXT_KB : n;
    const int64_t koff = hk * j->D * j->es, voff = hk * j->Dv * j->es;
    for (int64_t x = 0; x < end - k0; x++) {
        kr[x] = j->kp + slots[k0 + x] * j->k_row + koff;
        vr[x] = j->vp + slots[k0 + x] * j->v_row + voff;
    }
    *k1 = end;
    return end - k0;
}

/* measured on Zen 4 (Llama-3.2-1B's heads, 32 sequences of 140 keys scattered over a pool four
   times their size, 16 layers: benchmarks/decode_attention.py): asking for each block's rows
   at once, before its first row is read, took a step's attention from 27.6 to 22-23 ms on one
   thread; reading further ahead (0 to 192 KiB) measured the same */
#define DEC_AHEAD_BYTES (48 * 1024)

/* the rows of the next `bytes` of keys of the thread's items asked into L2 (see dec_ahead) */
static inline void dec_ahead_advance(const attention_job *j, dec_ahead *a, int64_t bytes) {
    const int64_t row = (j->D + j->Dv) * j->es;
    for (int64_t keys = (bytes + row - 1) / row; keys > 0 && a->item < a->end;) {
        const int64_t b = a->item / j->Hk, hk = a->item % j->Hk;
        int64_t n;
        const int64_t first = decode_window_start(j, b, &n), start = first & ~(int64_t)1;
        n += first; /* keys start .. n - 1, as decode_item walks them */
        const int64_t *slots = j->table + j->rows[b] * j->table_stride;
        const int64_t koff = hk * j->D * j->es, voff = hk * j->Dv * j->es;
        const int64_t from = a->key > start ? a->key : start;
        const int64_t stop = from + keys < n ? from + keys : n;
        for (int64_t t = from; t < stop; t++) {
            prefetch_l2(j->kp + slots[t] * j->k_row + koff, j->D * j->es);
            prefetch_l2(j->vp + slots[t] * j->v_row + voff, j->Dv * j->es);
        }
        keys -= stop - from;
        a->key = stop;
        if (stop >= n) {
            a->item++;
            a->key = 0;
        }
    }
}

/* This thread's buffers for job j's items and groups of `keys` keys; -1 when out of memory. */
static inline int dec_buffers_get(const attention_job *j, int64_t keys, dec_buffers *b) {
    const int64_t G = j->Hq / j->Hk, D = j->D, Dv = j->Dv;
    float *buf = scratch_f32(keys * D + G * (Dv + DEC_SLD + D + 3));
    if (!buf) return -1;
    b->kt = buf; /* 64-byte aligned, as are o and s: D, Dv and DEC_SLD are multiples of 16 */
    b->o = b->kt + keys * D;
    b->s = b->o + G * Dv;
    b->qs = b->s + G * DEC_SLD;
    b->m = b->qs + G * D;
    b->l = b->m + G;
    b->alpha = b->l + G;
    return 0;
}

typedef struct {
    const char *q;
    int64_t q_stride;
    const char *kp, *vp;
    int64_t k_row, v_row;
    const int64_t *table, *rows, *q_starts, *prefix_lens, *extend_lens, *first_item;
    int64_t table_stride, B;
    char *out;
    int64_t out_stride, Hq, Hk, D, Dv, window, QT, es;
    float scale, softcap;
    int dtype, dp; /* dp: bfloat16 QK on vdpbf16ps (queries as pairs, keys read in place) */
    const int32_t *tree_bits; /* per query token (q row): bit j = it sees new token j (j < 32) */
    atomic_int failed;
} extend_job;

/* One item: the new tokens t0 .. t0 + nt of sequence b against KV head hk; its `rows` query rows
   (row g * nt + i: query head hk * G + g, token t0 + i) see keys k_begin .. p_last. The kernels
   walk those keys in blocks that begin at k_begin rounded down to even and end at multiples of
   EXT_KB (the keys a row does not see add exact zeros), so that a row's arithmetic depends on its
   own position and keys only, not on the item it came in, and the decode kernels repeat it. */
typedef struct {
    int64_t b, hk, t0, nt, rows, k_begin, p_last;
    const int64_t *slots;
} extend_item;

static inline extend_item extend_locate(const extend_job *j, int64_t item) {
    extend_item it;
    const int64_t tile_item = item / j->Hk;
    it.hk = item % j->Hk;
    it.b = 0; /* first_item[b] <= item / Hk < first_item[b + 1] */
    while (j->first_item[it.b + 1] <= tile_item) it.b++;
    const int64_t prefix = j->prefix_lens[it.b], L = j->extend_lens[it.b];
    it.t0 = (tile_item - j->first_item[it.b]) * j->QT;
    it.nt = L - it.t0 < j->QT ? L - it.t0 : j->QT;
    it.slots = j->table + j->rows[it.b] * j->table_stride;
    it.rows = (j->Hq / j->Hk) * it.nt;
    const int64_t p_first = prefix + it.t0;
    it.p_last = p_first + it.nt - 1;
    it.k_begin = j->window > 0 && p_first - j->window + 1 > 0 ? p_first - j->window + 1 : 0;
    return it;
}

/* A thread's buffers for its items: qt [D][64] (queries transposed), st [KB][64] (scores),
   ot [Dv][64] (output), kf [KB][D] and vf [KB][Dv] (bfloat16 keys/values widened), the running
   maximum and sum of each row, each row's position (-1: a padding row) and, for a token tree,
   the new tokens each row sees (tree_bits). */
typedef struct {
    float *qt, *st, *ot, *kf, *vf, *mrow, *lrow;
    int32_t *pos, *tbits;
} extend_buffers;

static inline int extend_buffers_get(const extend_job *j, extend_buffers *s) {
    const int64_t D = j->D, Dv = j->Dv;
    float *buf = scratch_f32((D + EXT_KB + Dv) * EXT_ROWS + EXT_KB * (D + Dv) + 4 * EXT_ROWS);
    if (!buf) return -1;
    s->qt = buf;
    s->st = s->qt + D * EXT_ROWS;
    s->ot = s->st + EXT_KB * EXT_ROWS;
    s->kf = s->ot + Dv * EXT_ROWS;
    s->vf = s->kf + EXT_KB * D;
    s->mrow = s->vf + EXT_KB * Dv;
    s->lrow = s->mrow + EXT_ROWS;
    s->pos = (int32_t *)(s->lrow + EXT_ROWS);
    s->tbits = s->pos + EXT_ROWS;
    return 0;
}

/* The item's start: queries and output zero, maxima -inf, sums 0, positions. */
static inline void extend_item_reset(const extend_job *j, const extend_item *it,
                                     const extend_buffers *s) {
    const int64_t prefix = j->prefix_lens[it->b];
    memset(s->qt, 0, (size_t)(j->D * EXT_ROWS) * sizeof(float));
    memset(s->ot, 0, (size_t)(j->Dv * EXT_ROWS) * sizeof(float));
    for (int64_t r = 0; r < EXT_ROWS; r++) {
        s->pos[r] = r < it->rows ? (int32_t)(prefix + it->t0 + r % it->nt) : -1;
        s->tbits[r] = j->tree_bits && r < it->rows
                          ? j->tree_bits[j->q_starts[it->b] + it->t0 + r % it->nt] : -1;
        s->mrow[r] = -INFINITY;
        s->lrow[r] = 0.0f;
    }
}

/* Query row r of the item in q, and its output row in out. */
static inline const char *extend_q_row(const extend_job *j, const extend_item *it, int64_t r) {
    const int64_t G = j->Hq / j->Hk;
    return j->q + ((j->q_starts[it->b] + it->t0 + r % it->nt) * j->q_stride
                   + (it->hk * G + r / it->nt) * j->D) * j->es;
}

static inline char *extend_out_row(const extend_job *j, const extend_item *it, int64_t r) {
    const int64_t G = j->Hq / j->Hk;
    return j->out + ((j->q_starts[it->b] + it->t0 + r % it->nt) * j->out_stride
                     + (it->hk * G + r / it->nt) * j->Dv) * j->es;
}

/* qt[d][r] = scale * q_r[d] for the item's rows (bfloat16 widened) */
static inline void extend_load_queries(const extend_job *j, const extend_item *it, float *qt) {
    for (int64_t r = 0; r < it->rows; r++) {
        const char *qr = extend_q_row(j, it, r);
        for (int64_t d = 0; d < j->D; d++) {
            float v;
            if (j->dtype) {
                const uint32_t bits = (uint32_t)((const uint16_t *)qr)[d] << 16;
                memcpy(&v, &bits, 4);
            } else {
                v = ((const float *)qr)[d];
            }
            qt[d * EXT_ROWS + r] = v * j->scale;
        }
    }
}

/* for dp: qt2[p][r] = the bfloat16 pair q_r[2p], q_r[2p + 1] (unscaled: the scores are scaled) */
static inline void extend_load_query_pairs(const extend_job *j, const extend_item *it,
                                           uint32_t *qt2) {
    for (int64_t r = 0; r < it->rows; r++) {
        const uint16_t *qr = (const uint16_t *)extend_q_row(j, it, r);
        for (int64_t p = 0; p < j->D / 2; p++)
            qt2[p * EXT_ROWS + r] = (uint32_t)qr[2 * p] | (uint32_t)qr[2 * p + 1] << 16;
    }
}

static inline int run_extend_attention(
    sgl_range_fn items_fn, const void *q, int64_t q_stride, const void *k_pool,
    const void *v_pool, const int64_t *table, int64_t table_stride, const int64_t *rows,
    const int64_t *q_starts, const int64_t *prefix_lens, const int64_t *extend_lens, int64_t B,
    void *out, int64_t out_stride, int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, float scale,
    float softcap, int64_t window, int dtype, int bf16_dot, const int32_t *tree_bits) {
    if (D % 16 || Dv % 16 || D < 16 || Dv < 16 || D > 256 || Dv > 256 || Hk < 1 || Hq % Hk
        || Hq / Hk > EXT_ROWS || B < 0) return -1;
    const int64_t G = Hq / Hk, es = dtype ? 2 : 4;
    int64_t *first_item = malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!first_item) return -2;
    const int64_t QT = EXT_ROWS / G;
    first_item[0] = 0;
    for (int64_t b = 0; b < B; b++)
        first_item[b + 1] = first_item[b] + (extend_lens[b] + QT - 1) / QT;
    extend_job job = {q, q_stride, k_pool, v_pool, Hk * D * es, Hk * Dv * es, table, rows,
                      q_starts, prefix_lens, extend_lens, first_item, table_stride, B, out,
                      out_stride, Hq, Hk, D, Dv, window, QT, es, scale, softcap, dtype,
                      dtype && bf16_dot, tree_bits, 0};
    sgl_parallel_for(items_fn, &job, first_item[B] * Hk, 1);
    free(first_item);
    return atomic_load(&job.failed) ? -2 : 0;
}

/* -- the int8 matmul of sgl::linear_w8a8 (kernels_w8a8.c, kernels_w8a8_avx512.c) ------------- */

typedef struct {
    const uint8_t *wp; /* the packed weight, w + 128 */
    const float *sw;   /* per output channel */
    void *y;
    const float *bias;
    int64_t ldy, M, N, K, Kp;
    int dtype;
    const int8_t *xq; /* x's rows rounded: [Mp, Kp] with row stride ldq, zero-padded */
    int64_t ldq;
    const float *sx;  /* per row: max|x| / 127 */
    const int32_t *xs; /* per row: 128 * sum(q), the share of the stored offset */
} w8a8_job;

/* rows of x are padded to this many for AMX's 16-row tiles */
#define W8A8_ROWS_ALIGN 16

/* Checks the shapes, rounds x into the calling thread's scratch and fills the job: 0, -1
   (arguments refused: K above 65536 could overflow the int32 sums), -2 (no memory). */
static inline int w8a8_setup(w8a8_job *j, const void *x, int64_t ldx, const uint8_t *wp,
                             const float *sw, void *y, int64_t ldy, int64_t M, int64_t N,
                             int64_t K, const float *bias, int dtype) {
    if (M < 0 || N < 1 || K < 1 || K > 65536) return -1;
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    /* one cache line more than Kp: rows a power of two apart would share the L1 sets, and the
       16 rows of an AMX tile (or 4 of a VNNI tile) would evict each other */
    const int64_t ldq = Kp + 64;
    const int64_t Mp = (M + W8A8_ROWS_ALIGN - 1) / W8A8_ROWS_ALIGN * W8A8_ROWS_ALIGN;
    char *s = sgl_scratch(1, (size_t)(Mp * ldq + 8 * M + 64));
    if (!s) return -2;
    int8_t *xq = (int8_t *)s;
    float *sx = (float *)(s + Mp * ldq);
    int32_t *xs = (int32_t *)(sx + M);
    sgl_w8a8_round_rows(x, ldx, dtype, M, Mp, K, ldq, xq, sx, xs);
    *j = (w8a8_job){wp, sw, y, bias, ldy, M, N, K, Kp, dtype, xq, ldq, sx, xs};
    return 0;
}

/* the nearest bfloat16 of v (ties to even; a NaN stays a NaN), as torch rounds */
static inline uint16_t w8a8_bf16_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits | 0x400000u) >> 16);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* y[r, n0 + c] for the channels c < 16 that exist, from each one's int32 sum */
static inline void w8a8_store_row(const w8a8_job *j, int64_t r, int64_t n0,
                                  const int32_t *sums) {
    const int64_t cols = j->N - n0 < 16 ? j->N - n0 : 16;
    const float sx = j->sx[r];
    for (int64_t c = 0; c < cols; c++) {
        float v = (float)(sums[c] - j->xs[r]) * sx * j->sw[n0 + c];
        if (j->bias) v = v + j->bias[n0 + c];
        if (j->dtype)
            ((uint16_t *)j->y)[r * j->ldy + n0 + c] = w8a8_bf16_of(v);
        else
            ((float *)j->y)[r * j->ldy + n0 + c] = v;
    }
}

#endif
