/* kern_salr: magnitude pruning, the truncated-SVD residual adapter, the pipelined sparse x dense
 * product and the concatenated adapter GEMM pair (see kern_salr.h). */
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np */
#include "kern_salr.h"
#include "kern_salr_simd.h"

#include <lapacke.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"

#define TR KERN_BITMAP_TILE_ROWS

static inline bool fits_int(size_t v)
{
    return v <= (size_t)INT_MAX;
}

/* ---- pruning -------------------------------------------------------------------------------------- */

static inline uint32_t abs_key(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x & 0x7fffffffu; /* for non-NaN floats, |a| < |b| iff key(a) < key(b) */
}

/* hist[d] += number of i with (key_i & mask) == prefix and digit d = (key_i >> shift) & dmask.
 * Four interleaved 32-bit sub-histograms (flushed every 2^30 elements) avoid the store-forwarding
 * chain on a hot bucket; matching is branchless. Returns false if a NaN is seen. */
static bool radix_histogram(const float *w, size_t total, uint32_t mask, uint32_t prefix, unsigned shift,
                            uint32_t dmask, size_t *hist)
{
    enum { SUB = 4, CHUNK = 1 << 30 };
    size_t    nb = (size_t)dmask + 1;
    uint32_t *sub = fu_calloc(SUB * nb, sizeof(uint32_t));
    uint32_t  nan_seen = 0;
    for (size_t c0 = 0; c0 < total; c0 += CHUNK) {
        size_t c1 = total - c0 < CHUNK ? total : c0 + CHUNK;
        size_t i = c0;
        for (; i + SUB <= c1; i += SUB)
            for (size_t j = 0; j < SUB; j++) {
                uint32_t k = abs_key(w[i + j]);
                nan_seen |= k > 0x7f800000u;
                sub[j * nb + ((k >> shift) & dmask)] += (k & mask) == prefix;
            }
        for (; i < c1; i++) {
            uint32_t k = abs_key(w[i]);
            nan_seen |= k > 0x7f800000u;
            sub[(k >> shift) & dmask] += (k & mask) == prefix;
        }
        for (size_t j = 0; j < SUB; j++)
            for (size_t d = 0; d < nb; d++) {
                hist[d] += sub[j * nb + d];
                sub[j * nb + d] = 0;
            }
    }
    free(sub);
    return !nan_seen;
}

fu_err kern_salr_prune(const float *w, size_t rows, size_t cols, double sparsity, float *w_sparse,
                       float *residual, size_t *n_kept)
{
    size_t total;
    if (!w || !w_sparse || rows == 0 || cols == 0 || !fu_size_mul(rows, cols, &total) ||
        !(sparsity >= 0.0 && sparsity <= 1.0) || (residual && residual == w))
        return FU_EINVAL;

    size_t n_prune = (size_t)floor(sparsity * (double)total + 0.5);
    if (n_prune > total)
        n_prune = total;
    size_t n_keep = total - n_prune;

    /* Radix selection of the n_keep-th largest key: 11 + 11 + 10 bits, most significant first.
     * After the passes `thr` is that key and `need` how many elements equal to it are kept. The
     * first pass also rejects NaN (it has no magnitude order). */
    static const unsigned shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    uint32_t thr = 0, prefix_mask = 0;
    size_t   need = n_keep;
    size_t  *hist = fu_malloc(sizeof(size_t) << 11);
    for (int p = 0; p < 3; p++) {
        size_t   nb = (size_t)1 << widths[p];
        uint32_t digit_mask = (uint32_t)(nb - 1);
        memset(hist, 0, nb * sizeof *hist);
        if (!radix_histogram(w, total, prefix_mask, thr, shifts[p], digit_mask, hist)) {
            free(hist);
            return FU_EINVAL;
        }
        if (n_keep == 0)
            break; /* nothing to select; the pass only checked for NaN */
        size_t bkt = nb - 1;
        for (;;) {
            if (hist[bkt] >= need || bkt == 0)
                break;
            need -= hist[bkt];
            bkt--;
        }
        thr |= (uint32_t)bkt << shifts[p];
        prefix_mask |= digit_mask << shifts[p];
    }
    free(hist);

    /* Keep key > thr, and the first `need` elements (by index) with key == thr. */
    for (size_t i = 0; i < total; i++) {
        float    v = w[i];
        uint32_t k = abs_key(v);
        bool     keep = false;
        if (n_keep > 0) {
            if (k > thr) {
                keep = true;
            } else if (k == thr && need > 0) {
                keep = true;
                need--;
            }
        }
        if (residual)
            residual[i] = keep ? 0.0f : v;
        w_sparse[i] = keep ? v : 0.0f;
    }
    if (n_kept)
        *n_kept = n_keep;
    return FU_OK;
}

/* ---- truncated SVD of the residual ------------------------------------------------------------- */

/* splitmix64 and Box-Muller: a reproducible Gaussian stream for the range sketch. */
static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void gaussian_fill(float *dst, size_t n, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i += 2) {
        double u1 = ((double)(splitmix64(&s) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
        double u2 = (double)(splitmix64(&s) >> 11) * 0x1p-53;
        double rad = sqrt(-2.0 * log(u1)), ang = 2.0 * M_PI * u2;
        dst[i] = (float)(rad * cos(ang));
        if (i + 1 < n)
            dst[i + 1] = (float)(rad * sin(ang));
    }
}

static double frob2(const float *a, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * (double)a[i];
    return s;
}

/* Writes lora_b = U[:, :rank] * sqrt(s), lora_a = sqrt(s) * Vt[:rank, :]. */
static void write_factors(const float *u, size_t ldu, const float *s, const float *vt, size_t ldvt,
                          size_t rows, size_t cols, size_t rank, float *lora_a, float *lora_b)
{
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < rank; j++)
            lora_b[i * rank + j] = u[i * ldu + j] * sqrtf(s[j]);
    for (size_t j = 0; j < rank; j++) {
        float sq = sqrtf(s[j]);
        for (size_t c = 0; c < cols; c++)
            lora_a[j * cols + c] = sq * vt[j * ldvt + c];
    }
}

static fu_err svd_exact(const float *r_mat, size_t rows, size_t cols, size_t rank, float *lora_a,
                        float *lora_b, double *err_ratio)
{
    size_t mn = rows < cols ? rows : cols;
    float *a = fu_malloc_aligned(rows * cols * sizeof(float));
    float *s = fu_malloc_aligned(mn * sizeof(float));
    float *u = fu_malloc_aligned(rows * mn * sizeof(float));
    float *vt = fu_malloc_aligned(mn * cols * sizeof(float));
    memcpy(a, r_mat, rows * cols * sizeof(float));
    lapack_int info = LAPACKE_sgesdd(LAPACK_ROW_MAJOR, 'S', (lapack_int)rows, (lapack_int)cols, a,
                                     (lapack_int)cols, s, u, (lapack_int)mn, vt, (lapack_int)cols);
    fu_err rc = FU_EINVAL;
    if (info == 0) {
        write_factors(u, mn, s, vt, cols, rows, cols, rank, lora_a, lora_b);
        double tot = 0.0, tail = 0.0;
        for (size_t j = 0; j < mn; j++) {
            double e = (double)s[j] * (double)s[j];
            tot += e;
            if (j >= rank)
                tail += e;
        }
        if (err_ratio)
            *err_ratio = tot > 0.0 ? tail / tot : 0.0;
        rc = FU_OK;
    }
    fu_free_aligned(a);
    fu_free_aligned(s);
    fu_free_aligned(u);
    fu_free_aligned(vt);
    return rc;
}

/* Replaces the columns of q [m, l] by an orthonormal basis of their span. */
static bool orthonormalize(float *q, size_t m, size_t l, float *tau)
{
    if (LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, (lapack_int)m, (lapack_int)l, q, (lapack_int)l, tau) != 0)
        return false;
    return LAPACKE_sorgqr(LAPACK_ROW_MAJOR, (lapack_int)m, (lapack_int)l, (lapack_int)l, q, (lapack_int)l,
                          tau) == 0;
}

/* Randomized SVD (Halko, Martinsson, Tropp 2011, algorithm 4.4). *err_ratio is exact for the
 * factors returned: they are the projection U_r U_r^T R, so ||R - R_r||^2 = ||R||^2 - sum s_j^2. */
static fu_err svd_randomized(const float *r_mat, size_t rows, size_t cols, size_t rank, uint64_t seed,
                             float *lora_a, float *lora_b, double *err_ratio)
{
    size_t mn = rows < cols ? rows : cols;
    size_t l = rank + KERN_SALR_SVD_OVERSAMPLE < mn ? rank + KERN_SALR_SVD_OVERSAMPLE : mn;
    int    m = (int)rows, k = (int)cols, li = (int)l;
    float *omega = fu_malloc_aligned(cols * l * sizeof(float)); /* also Z [cols, l] */
    float *y = fu_malloc_aligned(rows * l * sizeof(float));
    float *bs = fu_malloc_aligned(l * cols * sizeof(float));
    float *tau = fu_malloc_aligned(l * sizeof(float));
    float *ub = fu_malloc_aligned(l * l * sizeof(float));
    float *s = fu_malloc_aligned(l * sizeof(float));
    float *vt = fu_malloc_aligned(l * cols * sizeof(float));
    float *uu = fu_malloc_aligned(rows * rank * sizeof(float));
    fu_err rc = FU_EINVAL;

    gaussian_fill(omega, cols * l, seed);
    kern_cpu_sgemm(false, false, m, li, k, 1.0f, r_mat, k, omega, li, 0.0f, y, li);
    if (!orthonormalize(y, rows, l, tau))
        goto out;
    for (int it = 0; it < KERN_SALR_SVD_POWER_ITERS; it++) {
        kern_cpu_sgemm(true, false, k, li, m, 1.0f, r_mat, k, y, li, 0.0f, omega,
                    li);
        if (!orthonormalize(omega, cols, l, tau))
            goto out;
        kern_cpu_sgemm(false, false, m, li, k, 1.0f, r_mat, k, omega, li, 0.0f, y,
                    li);
        if (!orthonormalize(y, rows, l, tau))
            goto out;
    }
    /* bs [l, cols] = Q^T R; its SVD gives R's leading triplets within span(Q). */
    kern_cpu_sgemm(true, false, li, k, m, 1.0f, y, li, r_mat, k, 0.0f, bs, k);
    if (LAPACKE_sgesdd(LAPACK_ROW_MAJOR, 'S', li, k, bs, k, s, ub, li, vt, k) != 0)
        goto out;
    kern_cpu_sgemm(false, false, m, (int)rank, li, 1.0f, y, li, ub, li, 0.0f, uu,
                (int)rank);
    write_factors(uu, rank, s, vt, cols, rows, cols, rank, lora_a, lora_b);
    if (err_ratio) {
        double tot = frob2(r_mat, rows * cols), kept = 0.0;
        for (size_t j = 0; j < rank; j++)
            kept += (double)s[j] * (double)s[j];
        *err_ratio = tot > 0.0 ? (tot - kept > 0.0 ? (tot - kept) / tot : 0.0) : 0.0;
    }
    rc = FU_OK;
out:
    fu_free_aligned(omega);
    fu_free_aligned(y);
    fu_free_aligned(bs);
    fu_free_aligned(tau);
    fu_free_aligned(ub);
    fu_free_aligned(s);
    fu_free_aligned(vt);
    fu_free_aligned(uu);
    return rc;
}

fu_err kern_salr_svd(const float *r_mat, size_t rows, size_t cols, size_t rank, kern_salr_svd_method method,
                     uint64_t seed, float *lora_a, float *lora_b, double *err_ratio)
{
    size_t total;
    if (!r_mat || !lora_a || !lora_b || rows == 0 || cols == 0 || rank == 0 || !fits_int(rows) ||
        !fits_int(cols) || !fu_size_mul(rows, cols, &total) || total > SIZE_MAX / (4 * sizeof(float)))
        return FU_EINVAL;
    size_t mn = rows < cols ? rows : cols;
    if (rank > mn)
        return FU_EINVAL;
    switch (method) {
    case KERN_SALR_SVD_EXACT:
        return svd_exact(r_mat, rows, cols, rank, lora_a, lora_b, err_ratio);
    case KERN_SALR_SVD_RANDOMIZED:
        return svd_randomized(r_mat, rows, cols, rank, seed, lora_a, lora_b, err_ratio);
    case KERN_SALR_SVD_AUTO: {
        if (mn <= KERN_SALR_SVD_EXACT_MAX_DIM || rank + KERN_SALR_SVD_OVERSAMPLE >= mn)
            return svd_exact(r_mat, rows, cols, rank, lora_a, lora_b, err_ratio);
        double ratio = 1.0;
        FU_TRY(svd_randomized(r_mat, rows, cols, rank, seed, lora_a, lora_b, &ratio));
        double bound = 1.0 - (double)rank / (double)mn;
        /* The sketch must leave a margin for float rounding; otherwise pay for the exact SVD. */
        if (ratio > bound * (1.0 - 1e-4))
            return svd_exact(r_mat, rows, cols, rank, lora_a, lora_b, err_ratio);
        if (err_ratio)
            *err_ratio = ratio;
        return FU_OK;
    }
    default:
        return FU_EINVAL;
    }
}

/* ---- sparse x dense product --------------------------------------------------------------------- */

/* Work over tile rows shared by threads: they take chunks of tile rows from `next` (work stealing),
 * so a thread slowed down by another process, or by OpenBLAS workers still spinning after a GEMM,
 * simply does fewer chunks. With fn NULL the work is the fused product, else fn (a decode). */
typedef struct tile_job tile_job;
struct tile_job {
    const kern_bitmap_view *v;
    kern_simd_isa           isa;
    const float            *x;
    size_t                  n;
    float                  *y;
    bool                    accumulate;
    size_t                  chunk; /* tile rows per chunk */
    size_t                  next;  /* first tile row not yet taken (atomic) */
    size_t                  end;   /* tile rows [next, end) are the job's */
    size_t                  row0;  /* decode: the first row of the block y points to */
    void (*fn)(tile_job *j, size_t tr0, size_t tr1);
};

static void tile_job_work(tile_job *j)
{
    size_t ldx = j->v->cols, ldy = j->v->rows;
    for (;;) {
        size_t tr0 = __atomic_fetch_add(&j->next, j->chunk, __ATOMIC_RELAXED);
        if (tr0 >= j->end)
            break;
        size_t tr1 = j->end - tr0 < j->chunk ? j->end : tr0 + j->chunk;
        if (j->fn) {
            j->fn(j, tr0, tr1);
            continue;
        }
        for (size_t b0 = 0; b0 < j->n; b0 += KERN_SALR_FUSED_MAX_BATCH) {
            size_t nb = j->n - b0 < KERN_SALR_FUSED_MAX_BATCH ? j->n - b0 : KERN_SALR_FUSED_MAX_BATCH;
            const float *x = j->x + b0 * ldx;
            float       *y = j->y + b0 * ldy;
            if (j->isa == KERN_SIMD_AVX512)
                kern_salr_spmv_avx512(j->v, tr0, tr1, x, ldx, nb, y, ldy, j->accumulate);
            else if (j->isa == KERN_SIMD_AVX2)
                kern_salr_spmv_avx2(j->v, tr0, tr1, x, ldx, nb, y, ldy, j->accumulate);
            else
                kern_salr_spmv_scalar(j->v, tr0, tr1, x, ldx, nb, y, ldy, j->accumulate);
        }
    }
}

static void *tile_job_thread(void *arg)
{
    tile_job_work(arg);
    return NULL;
}

/* A persistent helper thread for the common 2-thread case. Starting a thread per call cost about
 * 50 us, and a plain condition-variable hand-off made every call wait for the helper to wake even
 * when the caller had done all the work: in token generation (85 products of 0.05-0.16 ms per
 * token) the second thread bought almost nothing. So:
 *   - the caller opens the job (open = its generation) and works on it at once;
 *   - the helper joins only by closing `open` (compare-and-swap) while the job is still open;
 *   - when the caller finishes its chunks it tries to close `open` itself: if it wins, the helper
 *     never joined and the caller returns without waiting; otherwise it waits for `done`.
 * Between jobs the helper sleeps on the condition variable. Spinning instead was measured twice
 * and lost badly: a helper spinning 200 us after each product took the core from OpenBLAS's and
 * OpenMP's workers between products and cut SALR generation from 81 to 53 tokens/s (an OpenMP
 * team instead of this thread: 42). One caller at a time uses it; concurrent callers start their
 * own threads.
 *
 * The helper may run on every CPU of the process except the one its caller is on (helper_place).
 * Left to the scheduler, a woken helper often landed on its caller's core: right after a dense
 * OpenBLAS call the other core is busy with an OpenBLAS worker that spins (yielding) for ~0.1 s,
 * and after an idle spell the helper took 1-2 ms to move. Either way the product ran at one
 * core's speed, 4.6 ms for 11008 x 4096 at batch 1 against 2.3 ms with the helper placed. */

static struct {
    pthread_mutex_t use;      /* held by the caller that owns the helper for one product */
    pthread_mutex_t mu;       /* with cv: sleeping and waking */
    pthread_cond_t  cv;
    bool            alive;    /* the thread is running (under mu) */
    bool            failed;   /* it could not be started: do not retry (under mu) */
    pthread_t       th;       /* the thread (valid while alive) */
    int             cpu;      /* the caller's CPU the helper was last kept off (owner of `use`) */
    uint64_t        gen;      /* jobs handed out (owner of `use` only) */
    uint64_t        open;     /* atomic: the generation the helper may join, 0 when none */
    uint64_t        done;     /* atomic: the last generation the helper finished */
    int             sleeping; /* atomic: the helper waits on cv */
    int             waiting;  /* atomic: the caller waits on cv */
    tile_job       *job;      /* the job of generation `open` */
} helper = {.use = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
            .cpu = -1};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *helper_main(void *arg)
{
    (void)arg;
    for (;;) {
        uint64_t g = __atomic_load_n(&helper.open, __ATOMIC_SEQ_CST);
        if (g == 0) { /* sleep until a job opens */
            pthread_mutex_lock(&helper.mu);
            __atomic_store_n(&helper.sleeping, 1, __ATOMIC_SEQ_CST);
            while ((g = __atomic_load_n(&helper.open, __ATOMIC_SEQ_CST)) == 0)
                pthread_cond_wait(&helper.cv, &helper.mu);
            __atomic_store_n(&helper.sleeping, 0, __ATOMIC_RELAXED);
            pthread_mutex_unlock(&helper.mu);
        }
        if (!__atomic_compare_exchange_n(&helper.open, &g, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue; /* the caller closed it first */
        tile_job_work(helper.job);
        __atomic_store_n(&helper.done, g, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&helper.waiting, __ATOMIC_SEQ_CST)) {
            pthread_mutex_lock(&helper.mu);
            pthread_cond_broadcast(&helper.cv);
            pthread_mutex_unlock(&helper.mu);
        }
    }
    return NULL;
}

/* Keeps the helper off the CPU the caller runs on, so the two never share a core while another is
 * free (see above). Only when the caller has moved; a failure leaves the scheduler's choice. */
static void helper_place(void)
{
#ifdef __linux__
    int cpu = sched_getcpu();
    if (cpu < 0 || cpu == helper.cpu)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0 || !CPU_ISSET(cpu, &set) || CPU_COUNT(&set) < 2)
        return;
    CPU_CLR(cpu, &set);
    if (pthread_setaffinity_np(helper.th, sizeof set, &set) == 0)
        helper.cpu = cpu;
#endif
}

/* Runs the job on this thread and, when it wakes in time, the helper; false (nothing run) if the
 * helper is busy or cannot be started. */
static bool helper_run(tile_job *job)
{
    if (pthread_mutex_trylock(&helper.use) != 0)
        return false;
    pthread_mutex_lock(&helper.mu);
    if (!helper.alive && !helper.failed) {
        pthread_t      th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &attr, helper_main, NULL) == 0) {
            helper.alive = true;
            helper.th = th;
        } else
            helper.failed = true;
        pthread_attr_destroy(&attr);
    }
    bool alive = helper.alive;
    pthread_mutex_unlock(&helper.mu);
    if (!alive) {
        pthread_mutex_unlock(&helper.use);
        return false;
    }
    helper_place();
    uint64_t g = ++helper.gen;
    helper.job = job;
    __atomic_store_n(&helper.open, g, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&helper.sleeping, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&helper.mu);
        pthread_cond_broadcast(&helper.cv);
        pthread_mutex_unlock(&helper.mu);
    }
    tile_job_work(job);
    uint64_t expect = g;
    if (!__atomic_compare_exchange_n(&helper.open, &expect, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        /* the helper joined: it is finishing its last chunk */
        for (unsigned i = 0; i < 4096 && __atomic_load_n(&helper.done, __ATOMIC_ACQUIRE) != g; i++)
            cpu_relax();
        if (__atomic_load_n(&helper.done, __ATOMIC_ACQUIRE) != g) {
            pthread_mutex_lock(&helper.mu);
            __atomic_store_n(&helper.waiting, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&helper.done, __ATOMIC_SEQ_CST) != g)
                pthread_cond_wait(&helper.cv, &helper.mu);
            __atomic_store_n(&helper.waiting, 0, __ATOMIC_RELAXED);
            pthread_mutex_unlock(&helper.mu);
        }
    }
    pthread_mutex_unlock(&helper.use);
    return true;
}

#define SALR_MAX_THREADS 64

/* Runs a tile-row job on nt threads (the persistent helper for 2, fresh threads otherwise). */
static void tile_job_run(tile_job *job, size_t nt)
{
    if (nt <= 1 || job->end - job->next <= job->chunk) {
        tile_job_work(job);
        return;
    }
    if (nt == 2 && helper_run(job))
        return;
    pthread_t th[SALR_MAX_THREADS];
    size_t    started = 1;
    for (size_t i = 1; i < nt; i++) {
        if (pthread_create(&th[i], NULL, tile_job_thread, job) != 0)
            break; /* the threads that did start, and this one, take all the chunks */
        started++;
    }
    tile_job_work(job);
    for (size_t i = 1; i < started; i++)
        pthread_join(th[i], NULL);
}

static fu_err spmm_fused(const kern_bitmap_view *v, kern_simd_isa isa, const float *x, size_t n, float *y,
                         bool accumulate, size_t nt)
{
    if (nt > v->tiles_r)
        nt = v->tiles_r;
    if (nt < 1)
        nt = 1;
    size_t chunk = v->tiles_r / (8 * nt);
    if (chunk < 2)
        chunk = 2;
    tile_job job = {v, isa, x, n, y, accumulate, chunk, 0, v->tiles_r, 0, NULL};
    tile_job_run(&job, nt);
    return FU_OK;
}

/* One cached scratch buffer for the dense row blocks (reused across calls; a concurrent call that
 * finds it taken allocates its own). */
static pthread_mutex_t scratch_mu = PTHREAD_MUTEX_INITIALIZER;
static float          *scratch_buf;
static size_t          scratch_len;

static float *scratch_take(size_t bytes)
{
    float *p = NULL;
    pthread_mutex_lock(&scratch_mu);
    if (scratch_buf && scratch_len >= bytes) {
        p = scratch_buf;
        scratch_buf = NULL;
    }
    pthread_mutex_unlock(&scratch_mu);
    return p ? p : fu_malloc_aligned(bytes);
}

/* Gives back a buffer of `bytes` taken with scratch_take; the bigger of it and the cached one is
 * kept. */
static void scratch_give(float *p, size_t bytes)
{
    pthread_mutex_lock(&scratch_mu);
    if (!scratch_buf || scratch_len < bytes) {
        float *old = scratch_buf;
        scratch_buf = p;
        scratch_len = bytes;
        p = old;
    }
    pthread_mutex_unlock(&scratch_mu);
    fu_free_aligned(p);
}

void kern_salr_scratch_release(void)
{
    pthread_mutex_lock(&scratch_mu);
    float *p = scratch_buf;
    scratch_buf = NULL;
    scratch_len = 0;
    pthread_mutex_unlock(&scratch_mu);
    fu_free_aligned(p);
}

/* Large batches: W is decoded to dense row blocks of rb rows (a multiple of the tile height), each
 * multiplied with one kern_cpu_sgemm. Both strategies use the same blocks, fixed by W's shape (at
 * least 4, at most KERN_SALR_BLOCK_BYTES / 2 each), so their results have the same bits. */
typedef struct {
    const kern_bitmap_view *v;
    kern_simd_isa           isa;
    size_t                  rb;      /* rows per block */
    size_t                  nblocks; /* ceil(rows / rb) */
} row_blocks;

static row_blocks blocks_of(const kern_bitmap_view *v, kern_simd_isa isa)
{
    size_t cap = KERN_SALR_BLOCK_BYTES / 2 / (v->cols * sizeof(float)) / TR * TR;
    if (cap < TR)
        cap = TR;
    size_t nb = (v->rows + cap - 1) / cap;
    if (nb < 4)
        nb = 4;
    size_t rb = ((v->rows + nb - 1) / nb + TR - 1) / TR * TR; /* balanced: no small last block */
    return (row_blocks){v, isa, rb, (v->rows + rb - 1) / rb};
}

static size_t block_rows(const row_blocks *b, size_t blk)
{
    size_t r0 = blk * b->rb;
    return b->v->rows - r0 < b->rb ? b->v->rows - r0 : b->rb;
}

static void block_gemm(const row_blocks *b, size_t blk, const float *dense, const float *x, size_t n, float *y,
                       bool accumulate)
{
    size_t r0 = blk * b->rb, nr = block_rows(b, blk);
    kern_cpu_sgemm(false, true, (int)n, (int)nr, (int)b->v->cols, 1.0f, x,
                (int)b->v->cols, dense, (int)b->v->cols, accumulate ? 1.0f : 0.0f, y + r0, (int)b->v->rows);
}

/* tile_job callback: decodes tile rows [tr0, tr1) into the block that starts at row j->row0. */
static void decode_part(tile_job *j, size_t tr0, size_t tr1)
{
    size_t r0 = tr0 * TR, r1 = tr1 * TR < j->v->rows ? tr1 * TR : j->v->rows;
    kern_bitmap_decode_view(j->v, r0, r1 - r0, j->y + (r0 - j->row0) * j->v->cols, j->v->cols, j->isa);
}

/* Decodes block blk into dst with nt threads. */
static void block_decode(const row_blocks *b, size_t blk, float *dst, size_t nt)
{
    size_t row0 = blk * b->rb;
    size_t t0 = row0 / TR, t1 = (row0 + block_rows(b, blk) + TR - 1) / TR;
    size_t chunk = (t1 - t0) / (4 * (nt ? nt : 1));
    tile_job job = {b->v, b->isa, NULL, 0, dst, false, chunk ? chunk : 1, t0, t1, row0, decode_part};
    tile_job_run(&job, nt);
}

/* Decode a block with every thread, multiply it with every BLAS thread, next block. When the BLAS
 * threads already fill the cores (the usual case) this beats overlapping the stages: the decoder
 * would only take cycles from the GEMM. Blocks are up to KERN_SALR_BLOCK_BYTES: big enough that
 * sgemm keeps its full speed (it re-packs X for every block), small enough to stay in L3. */
static fu_err spmm_blocked(const kern_bitmap_view *v, kern_simd_isa isa, const float *x, size_t n, float *y,
                           bool accumulate, size_t nt)
{
    row_blocks b = blocks_of(v, isa);
    size_t     bytes = b.rb * v->cols * sizeof(float);
    float     *dense = scratch_take(bytes);
    for (size_t blk = 0; blk < b.nblocks; blk++) {
        block_decode(&b, blk, dense, nt);
        block_gemm(&b, blk, dense, x, n, y, accumulate);
    }
    scratch_give(dense, bytes);
    return FU_OK;
}

/* Two-stage pipeline for when a core is left over from BLAS: a decode thread fills two dense row
 * blocks alternately while the calling thread multiplies the previous one. */
typedef struct {
    row_blocks      b;
    float          *slot[2];
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    size_t          produced; /* blocks decoded so far */
    size_t          consumed; /* blocks multiplied so far */
} spmm_pipe;

static void *pipe_decoder(void *arg)
{
    spmm_pipe *p = arg;
    for (size_t blk = 0; blk < p->b.nblocks; blk++) {
        pthread_mutex_lock(&p->mu);
        while (p->produced - p->consumed >= 2)
            pthread_cond_wait(&p->cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
        kern_bitmap_decode_view(p->b.v, blk * p->b.rb, block_rows(&p->b, blk), p->slot[blk & 1], p->b.v->cols,
                                p->b.isa);
        pthread_mutex_lock(&p->mu);
        p->produced++;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

static fu_err spmm_pipelined(const kern_bitmap_view *v, kern_simd_isa isa, const float *x, size_t n, float *y,
                             bool accumulate)
{
    spmm_pipe p = {.b = blocks_of(v, isa)};
    size_t    slot_floats = p.b.rb * v->cols, bytes = 2 * slot_floats * sizeof(float);
    float    *scratch = scratch_take(bytes);
    p.slot[0] = scratch;
    p.slot[1] = scratch + slot_floats;
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    pthread_t dec;
    bool      threaded = pthread_create(&dec, NULL, pipe_decoder, &p) == 0;
    for (size_t blk = 0; blk < p.b.nblocks; blk++) {
        if (threaded) {
            pthread_mutex_lock(&p.mu);
            while (p.produced <= blk)
                pthread_cond_wait(&p.cv, &p.mu);
            pthread_mutex_unlock(&p.mu);
        } else {
            kern_bitmap_decode_view(v, blk * p.b.rb, block_rows(&p.b, blk), p.slot[blk & 1], v->cols, isa);
        }
        block_gemm(&p.b, blk, p.slot[blk & 1], x, n, y, accumulate);
        if (threaded) {
            pthread_mutex_lock(&p.mu);
            p.consumed++;
            pthread_cond_broadcast(&p.cv);
            pthread_mutex_unlock(&p.mu);
        }
    }
    if (threaded)
        pthread_join(dec, NULL);
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    scratch_give(scratch, bytes);
    return FU_OK;
}

static kern_salr_strategy strategy = KERN_SALR_STRATEGY_AUTO;

void kern_salr_set_strategy(kern_salr_strategy s)
{
    __atomic_store_n(&strategy, s, __ATOMIC_RELAXED);
}

fu_err kern_salr_spmm(const kern_bitmap_t *w, const float *x, size_t n, float *y, bool accumulate,
                      int n_threads)
{
    if (!w || !x || !y || n == 0)
        return FU_EINVAL;
    kern_bitmap_view v;
    kern_bitmap_view_of(w, &v);
    if (!fits_int(n) || !fits_int(v.rows) || !fits_int(v.cols))
        return FU_EINVAL;
    size_t nt = n_threads <= 0 ? KERN_SALR_THREADS : (size_t)n_threads;
    if (nt > SALR_MAX_THREADS)
        nt = SALR_MAX_THREADS;
    kern_simd_isa isa = kern_simd_active();
    if (n <= KERN_SALR_FUSED_BATCH_LIMIT)
        return spmm_fused(&v, isa, x, n, y, accumulate, nt);
    kern_salr_strategy s = __atomic_load_n(&strategy, __ATOMIC_RELAXED);
    if (s == KERN_SALR_STRATEGY_AUTO) /* a spare core for the decoder: overlap; else take turns */
        s = nt > (size_t)kern_cpu_threads() ? KERN_SALR_STRATEGY_PIPELINED : KERN_SALR_STRATEGY_BLOCKED;
    if (s == KERN_SALR_STRATEGY_PIPELINED)
        return spmm_pipelined(&v, isa, x, n, y, accumulate);
    return spmm_blocked(&v, isa, x, n, y, accumulate, nt);
}

/* ---- concatenated adapters ---------------------------------------------------------------------- */

static bool dims_ok(const kern_salr_dims *d)
{
    return d && d->in > 0 && d->out > 0 && d->r1 + d->r2 > 0 && fits_int(d->in) && fits_int(d->out) &&
           fits_int(d->r1 + d->r2);
}

fu_err kern_salr_concat_build(const kern_salr_dims *d, const float *a1, const float *b1, float s1,
                              const float *a2, const float *b2, float s2, float *a_cat, float *b_cat)
{
    if (!dims_ok(d) || !a_cat || !b_cat || (d->r1 && (!a1 || !b1)) || (d->r2 && (!a2 || !b2)))
        return FU_EINVAL;
    size_t rt = d->r1 + d->r2;
    if (d->r1)
        memcpy(a_cat, a1, d->r1 * d->in * sizeof(float));
    if (d->r2)
        memcpy(a_cat + d->r1 * d->in, a2, d->r2 * d->in * sizeof(float));
    for (size_t i = 0; i < d->out; i++) {
        for (size_t j = 0; j < d->r1; j++)
            b_cat[i * rt + j] = s1 * b1[i * d->r1 + j];
        for (size_t j = 0; j < d->r2; j++)
            b_cat[i * rt + d->r1 + j] = s2 * b2[i * d->r2 + j];
    }
    return FU_OK;
}

fu_err kern_salr_concat_set_b1(const kern_salr_dims *d, const float *b1, float s1, float *b_cat)
{
    if (!dims_ok(d) || !b1 || !b_cat || d->r1 == 0)
        return FU_EINVAL;
    size_t rt = d->r1 + d->r2;
    for (size_t i = 0; i < d->out; i++)
        for (size_t j = 0; j < d->r1; j++)
            b_cat[i * rt + j] = s1 * b1[i * d->r1 + j];
    return FU_OK;
}

fu_err kern_salr_concat_forward(const kern_salr_dims *d, const float *a_cat, const float *b_cat,
                                const float *x, size_t n, float *h, float *y)
{
    if (!dims_ok(d) || !a_cat || !b_cat || !x || !h || !y || n == 0 || !fits_int(n))
        return FU_EINVAL;
    int rt = (int)(d->r1 + d->r2), in = (int)d->in, out = (int)d->out, ni = (int)n;
    kern_cpu_sgemm(false, true, ni, rt, in, 1.0f, x, in, a_cat, in, 0.0f, h, rt);
    kern_cpu_sgemm(false, true, ni, out, rt, 1.0f, h, rt, b_cat, rt, 1.0f, y, out);
    return FU_OK;
}

fu_err kern_salr_concat_backward(const kern_salr_dims *d, const float *a_cat, const float *b_cat, float s1,
                                 const float *h, const float *dy, size_t n, float *db1, const float *x,
                                 float *da1, float *dx)
{
    if (!dims_ok(d) || !a_cat || !b_cat || !h || !dy || n == 0 || !fits_int(n) || (da1 && !x) ||
        ((db1 || da1) && d->r1 == 0))
        return FU_EINVAL;
    int rt = (int)(d->r1 + d->r2), in = (int)d->in, out = (int)d->out, ni = (int)n, r1 = (int)d->r1;
    if (db1) /* dB1 = s1 * dY^T * H1, H1 = the first r1 columns of h (leading dimension rt) */
        kern_cpu_sgemm(true, false, out, r1, ni, s1, dy, out, h, rt, 0.0f, db1, r1);
    if (!da1 && !dx)
        return FU_OK;
    /* G [n, rt] = dY * b_cat = [s1 dY B1 | s2 dY B2] */
    float *g = fu_malloc_aligned(n * (size_t)rt * sizeof(float));
    kern_cpu_sgemm(false, false, ni, rt, out, 1.0f, dy, out, b_cat, rt, 0.0f, g, rt);
    if (da1)
        kern_cpu_sgemm(true, false, r1, in, ni, 1.0f, g, rt, x, in, 0.0f, da1, in);
    if (dx)
        kern_cpu_sgemm(false, false, ni, in, rt, 1.0f, g, rt, a_cat, in, 1.0f, dx, in);
    fu_free_aligned(g);
    return FU_OK;
}

fu_err kern_salr_linear_forward(const kern_bitmap_t *w, const kern_salr_dims *d, const float *a_cat,
                                const float *b_cat, const float *x, size_t n, float *h, float *y)
{
    if (!w)
        return FU_EINVAL;
    if (d && (d->in != kern_bitmap_cols(w) || d->out != kern_bitmap_rows(w)))
        return FU_EINVAL;
    FU_TRY(kern_salr_spmm(w, x, n, y, false, 0));
    if (!d)
        return FU_OK;
    return kern_salr_concat_forward(d, a_cat, b_cat, x, n, h, y);
}
