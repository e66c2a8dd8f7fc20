/* The kernels' thread pool and per-thread scratch buffers, shared by the kernels of every
 * instruction-set level (kernels.h). */
#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdlib.h>

/* -- a pool of helper threads for the kernels ------------------------------------------------
 * sgl_parallel_for(fn, ctx, n, chunk) runs fn(ctx, begin, end) over [0, n) in chunks that the caller
 * and the helpers claim from one atomic ticket, so a helper the OS has not scheduled yet just
 * claims nothing: the caller never waits for a helper to start, only for chunks already claimed.
 * The ticket holds the job number, its chunk count and the next chunk, so a claim knows from the
 * one atomic read whether it is a chunk of a live job. Helpers spin for
 * SPIN_US after a job (the next matmul of a layer follows within microseconds), then sleep on a
 * condition variable, so an idle server leaves the cores to other processes. With one thread
 * (the default until sgl_set_threads) everything runs on the caller. */

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define SPIN_US 200.0
#define MAX_THREADS 64
#define FIELD_BITS 20 /* the chunk count and the next chunk; the job number above them */
#define FIELD_MASK ((1ull << FIELD_BITS) - 1)
#define MAX_CHUNKS (1ll << (FIELD_BITS - 1))

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_mutex_t busy;        /* held by the thread whose job the pool runs */
    int threads;                 /* threads in use: the caller plus threads - 1 helpers */
    int started;                 /* helpers started (they are never stopped) */
    atomic_ullong ticket;        /* job << 40 | chunks << 20 | next chunk */
    atomic_llong done;           /* chunks finished of the current job */
    atomic_int sleeping;         /* helpers waiting on cv */
    sgl_range_fn fn;               /* the current job; written before its ticket */
    void *ctx;
    int64_t n, chunk;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
            .busy = PTHREAD_MUTEX_INITIALIZER, .threads = 1};

int sgl_pool_threads(void) { return pool.threads; }

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static inline uint64_t ticket_job(unsigned long long t) { return t >> (2 * FIELD_BITS); }

/* Claim and run chunks of the job the ticket holds; returns that job's number. A claim past the
 * last chunk (a late helper) runs nothing: the job's descriptor may already be the next one's. */
static uint64_t run_chunks(void) {
    for (;;) {
        const unsigned long long t = atomic_fetch_add(&pool.ticket, 1);
        const int64_t i = (int64_t)(t & FIELD_MASK);
        if (i >= (int64_t)((t >> FIELD_BITS) & FIELD_MASK)) return ticket_job(t);
        const int64_t begin = i * pool.chunk;
        const int64_t end = begin + pool.chunk < pool.n ? begin + pool.chunk : pool.n;
        pool.fn(pool.ctx, begin, end);
        atomic_fetch_add(&pool.done, 1);
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1, 2, ... */
    uint64_t seen = ticket_job(atomic_load(&pool.ticket));
    for (;;) {
        if (index >= pool.threads) { /* not in use: sleep until a job after a resize */
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleeping, 1);
            while (index >= pool.threads || ticket_job(atomic_load(&pool.ticket)) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        const double start = now_us();
        unsigned spins = 0;
        while (ticket_job(atomic_load(&pool.ticket)) == seen) {
            _mm_pause();
            if ((++spins & 255) == 0 && now_us() - start > SPIN_US) {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleeping, 1);
                while (ticket_job(atomic_load(&pool.ticket)) == seen)
                    pthread_cond_wait(&pool.cv, &pool.mu);
                atomic_fetch_sub(&pool.sleeping, 1);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        seen = run_chunks();
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
    /* a second caller thread while a job runs (the kernels are called from one thread in sgl,
     * but ctypes lets any thread in) runs its loop alone instead of sharing the one job slot */
    if (pool.threads == 1 || chunks <= 1 || chunks > MAX_CHUNKS
        || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, n);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.chunk = chunk;
    atomic_store(&pool.done, 0);
    const unsigned long long job = ticket_job(atomic_load(&pool.ticket)) + 1;
    atomic_store(&pool.ticket, (job << (2 * FIELD_BITS)) | ((unsigned long long)chunks << FIELD_BITS));
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    run_chunks();
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
