/* The kernels' thread pool and per-thread scratch buffers, shared by the kernels of every
 * instruction-set level (kernels.h). */
#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdlib.h>

/* -- a pool of helper threads for the kernels ------------------------------------------------
 * sgl_parallel_for(fn, ctx, n, chunk) runs fn(ctx, begin, end) over [0, n) in chunks of `chunk`
 * on the caller (thread 0) and the helpers (1, 2, ...). The chunks are dealt out in one
 * contiguous share per thread; a thread claims the chunks of its own share from the front, in
 * order (so a matmul's panel prefetch runs on from one claim into the next), then takes what is
 * left of the other shares from their backs. A thread the OS preempts, or a helper not yet
 * scheduled, holds up only the chunk it is in: the others finish its share. With one claim per
 * thread and no taking over, a process using 12% of one core slowed a batch-32 decode step by
 * 13%, its whole share of the stall (docs/kernels.md, "The thread pool").
 *
 * Each share is one atomic word, job << 40 | end << 20 | next, so a claim is one
 * compare-and-swap and a helper still on the last job finds every share "not its job". Helpers
 * spin for SPIN_US after a job (the next matmul of a layer follows within microseconds), then
 * sleep on a condition variable, so an idle server leaves the cores to other processes. With one
 * thread (the default until sgl_set_threads) everything runs on the caller. */

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define SPIN_US 200.0
#define MAX_THREADS 64
#define FIELD_BITS 20 /* a share's end and next chunk; the job number above them */
#define FIELD_MASK ((1ull << FIELD_BITS) - 1)
#define JOB_MASK ((1ull << (64 - 2 * FIELD_BITS)) - 1)
#define MAX_CHUNKS (1ll << (FIELD_BITS - 1))

/* one share per cache line: its owner claims from it at every chunk */
typedef struct {
    _Alignas(64) atomic_ullong word; /* job << 40 | end << 20 | next */
} share;

static share shares[MAX_THREADS];

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_mutex_t busy;        /* held by the thread whose job the pool runs */
    int threads;                 /* threads in use: the caller plus threads - 1 helpers */
    int started;                 /* helpers started (they are never stopped) */
    atomic_ullong job;           /* the current job's number, stored once its shares are */
    atomic_llong done;           /* chunks finished of the current job */
    atomic_int sleeping;         /* helpers waiting on cv */
    sgl_range_fn fn;             /* the current job; written before its shares */
    void *ctx;
    int64_t n, chunk;
    int shares;                  /* shares of the current job */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
            .busy = PTHREAD_MUTEX_INITIALIZER, .threads = 1};

int sgl_pool_threads(void) { return pool.threads; }

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static inline unsigned long long share_word(uint64_t job, int64_t end, int64_t next) {
    return (job << (2 * FIELD_BITS)) | ((unsigned long long)end << FIELD_BITS)
           | (unsigned long long)next;
}

/* Claim a chunk of share s of `job`, its first (`back` 0) or its last; -1 when the share has
   none left or belongs to another job. */
static int64_t claim(int s, uint64_t job, int back) {
    unsigned long long w = atomic_load_explicit(&shares[s].word, memory_order_acquire);
    for (;;) {
        if ((w >> (2 * FIELD_BITS)) != job) return -1;
        const int64_t next = (int64_t)(w & FIELD_MASK), end = (int64_t)((w >> FIELD_BITS) & FIELD_MASK);
        if (next >= end) return -1;
        const unsigned long long claimed = back ? share_word(job, end - 1, next)
                                                : share_word(job, end, next + 1);
        if (atomic_compare_exchange_weak_explicit(&shares[s].word, &w, claimed,
                                                  memory_order_acq_rel, memory_order_acquire))
            return back ? end - 1 : next;
    }
}

static void run_chunk(int64_t i) {
    const int64_t begin = i * pool.chunk;
    pool.fn(pool.ctx, begin, begin + pool.chunk < pool.n ? begin + pool.chunk : pool.n);
}

/* Thread `self` works on `job`: its own share from the front, then the others' from the back. */
static void work(int self, uint64_t job) {
    int64_t ran = 0, i;
    const int shares_of_job = pool.shares; /* read late by a helper of an older job: then every
                                              claim below fails on the job number */
    while ((i = claim(self, job, 0)) >= 0) {
        run_chunk(i);
        ran++;
    }
    for (int k = 1; k <= shares_of_job; k++) {
        const int s = (self + k) % shares_of_job;
        if (s == self) continue;
        while ((i = claim(s, job, 1)) >= 0) {
            run_chunk(i);
            ran++;
        }
    }
    if (ran) atomic_fetch_add(&pool.done, ran);
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1, 2, ... */
    uint64_t seen = atomic_load(&pool.job);
    for (;;) {
        if (index >= pool.threads) { /* not in use: sleep until a job after a resize */
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleeping, 1);
            while (index >= pool.threads || atomic_load(&pool.job) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        const double start = now_us();
        unsigned spins = 0;
        while (atomic_load(&pool.job) == seen) {
            _mm_pause();
            if ((++spins & 255) == 0 && now_us() - start > SPIN_US) {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleeping, 1);
                while (atomic_load(&pool.job) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
                atomic_fetch_sub(&pool.sleeping, 1);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        seen = atomic_load(&pool.job);
        work(index, seen);
    }
    return NULL;
}

/* Use `threads` threads (the caller included) from now on; helpers are started, never stopped.
 * Returns the number in use. Call it from one thread, between kernel calls. */
int sgl_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_mutex_lock(&pool.mu);
    while (pool.started < threads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper_main, (void *)(intptr_t)(pool.started + 1)) != 0)
            break;
        pthread_detach(t);
        pool.started++;
    }
    pool.threads = pool.started + 1 < threads ? pool.started + 1 : threads;
    pthread_mutex_unlock(&pool.mu);
    return pool.threads;
}

void sgl_parallel_for(sgl_range_fn fn, void *ctx, int64_t n, int64_t chunk) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    /* a call from inside a job's chunk (a kernel of one part of sgl_replay_parts, on the
     * caller or a helper), or from a second caller thread while a job runs, runs its loop alone
     * instead of sharing the one job slot */
    if (pool.threads == 1 || chunks <= 1 || chunks > MAX_CHUNKS
        || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, n);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.chunk = chunk;
    pool.shares = chunks < pool.threads ? (int)chunks : pool.threads;
    atomic_store(&pool.done, 0);
    const uint64_t job = (atomic_load(&pool.job) + 1) & JOB_MASK;
    for (int s = 0; s < pool.shares; s++)
        atomic_store_explicit(&shares[s].word,
                              share_word(job, chunks * (s + 1) / pool.shares, chunks * s / pool.shares),
                              memory_order_release);
    atomic_store(&pool.job, job);
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    work(0, job);
    while (atomic_load(&pool.done) < chunks) _mm_pause();
    pthread_mutex_unlock(&pool.busy);
}

/* Per-thread buffers that grow to the largest request and are kept: slot 0 holds bfloat16
 * copies, slot 1 float32 work (a kernel may use both at once). 64-byte aligned; NULL when out of
 * memory. */
static __thread void *scratch_buffer[2];
static __thread size_t scratch_bytes[2];

void *sgl_scratch(int slot, size_t bytes) {
    if (scratch_bytes[slot] < bytes) {
        free(scratch_buffer[slot]);
        scratch_buffer[slot] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes[slot] = scratch_buffer[slot] ? bytes : 0;
    }
    return scratch_buffer[slot];
}

/* rows per chunk of the elementwise kernels on the kernel threads (fewer rows run inline) */
#define ROWS_PER_CHUNK 8

int64_t sgl_row_chunk(int64_t T) {
    const int64_t c = T / (2 * (int64_t)pool.threads);
    return c < ROWS_PER_CHUNK ? ROWS_PER_CHUNK : c;
}

#endif

/* sgl_parallel_for deals a job's chunks out in one share per thread, and a thread that
 * finishes early can take over only whole chunks, so the chunk size matters as much as the
 * number of chunks: 18 panels (SmolLM2's o and down projections) in claims of 2 make 9 chunks,
 * shares of 4 and 5, and one thread runs 10 panels while the other waits after 8 (those
 * projections ran at 410 GFLOP/s against 450 for the evenly shared q/k/v and gate/up, 512 rows
 * on two Zen 4 cores). Of the chunk sizes from `cap` down to half of it, the one whose largest
 * share holds the fewest items; the largest on a tie. Built on every architecture (the tests
 * call it through ctypes). */
int64_t sgl_balanced_chunk(int64_t n, int64_t cap, int threads) {
    if (cap < 1) cap = 1;
    if (threads < 1) threads = 1;
    int64_t best = cap, best_load = INT64_MAX;
    for (int64_t c = cap; c >= 1 && 2 * c >= cap; c--) {
        const int64_t chunks = (n + c - 1) / c, shares = chunks < threads ? chunks : threads;
        int64_t load = 0;
        for (int64_t s = 0; s < shares; s++) { /* as sgl_parallel_for deals them */
            const int64_t begin = chunks * s / shares * c, end = chunks * (s + 1) / shares * c;
            const int64_t items = (end < n ? end : n) - begin;
            if (items > load) load = items;
        }
        if (load < best_load) {
            best = c;
            best_load = load;
        }
    }
    return best;
}
