/* kern_cpu_gemm: the CPU backend's matrix products, with the same bits for any thread count.
 *
 * OpenBLAS splits a product between its threads in ways that change the order of the sums (it
 * splits K for some shapes), so its results depend on its thread count (docs/DAG.md
 * "Determinism"). Here OpenBLAS always runs one thread per call, and the parallelism is ours: C is
 * cut into tiles whose bounds depend on (m, n) alone, each tile is one single-threaded OpenBLAS
 * call over the whole of K, and the backend's threads share the tiles. A tile is computed by the
 * same call whichever thread takes it, so C's bits are the same with 1, 2 or 64 threads.
 * Matrix-vector products are cut the same way into fixed blocks of rows or columns. */
#include <cblas.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"

/* OpenBLAS's own thread count; weak so that a BLAS without it still links. */
extern void openblas_set_num_threads(int n) __attribute__((weak));

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static _Atomic int gemm_mode = KERN_CPU_GEMM_DETERMINISTIC;

static void blas_one_thread(void)
{
    if (openblas_set_num_threads)
        openblas_set_num_threads(1);
}

void kern_cpu_gemm_set_mode(kern_cpu_gemm_mode mode)
{
    pthread_once(&blas_once, blas_one_thread);
    gemm_mode = mode;
    if (openblas_set_num_threads)
        openblas_set_num_threads(mode == KERN_CPU_GEMM_BLAS_THREADS ? kern_cpu_threads() : 1);
}

/* Threads for `units` independent pieces of `work` multiply-adds: 1 below KERN_GEMM_PAR_MIN (a
 * fork-join costs more), else as many as the backend has, at most one per piece. */
static int gemm_threads(double work, int64_t units)
{
    if (work < (double)KERN_GEMM_PAR_MIN || units < 2 || omp_in_parallel())
        return 1;
    int nt = kern_cpu_threads();
    return nt > units ? (int)units : nt;
}

/* y = alpha·op(M)·x + beta·y with op(M) [rows x cols] (M row-major, lda), cut into blocks of
 * KERN_GEMV_BLOCK rows (each row is one dot product: blocks of rows are independent). */
static void gemv_rows(bool trans, int rows, int cols, float alpha, const float *M, int lda, const float *x, int incx,
                      float beta, float *y, int incy)
{
    int64_t blocks = (rows + KERN_GEMV_BLOCK - 1) / KERN_GEMV_BLOCK;
    int nt = gemm_threads((double)rows * cols, blocks);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int r0 = (int)(b * KERN_GEMV_BLOCK), nr = rows - r0 < KERN_GEMV_BLOCK ? rows - r0 : KERN_GEMV_BLOCK;
        float *yb = y + (int64_t)r0 * incy;
        if (trans) /* M [cols x rows]: y = Mᵀ·x, the block is M's columns r0.. */
            cblas_sgemv(CblasRowMajor, CblasTrans, cols, nr, alpha, M + r0, lda, x, incx, beta, yb, incy);
        else       /* M [rows x cols]: the block is M's rows r0.. */
            cblas_sgemv(CblasRowMajor, CblasNoTrans, nr, cols, alpha, M + (int64_t)r0 * lda, lda, x, incx, beta, yb,
                        incy);
    }
}

void kern_cpu_sgemm(bool ta, bool tb, int m, int n, int k, float alpha, const float *A, int lda, const float *B,
                    int ldb, float beta, float *C, int ldc)
{
    pthread_once(&blas_once, blas_one_thread);
    if (m <= 0 || n <= 0)
        return;
    if (k <= 0) { /* BLAS may skip beta scaling for k == 0: do it here */
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++)
                C[(int64_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(int64_t)i * ldc + j];
        return;
    }
    if (gemm_mode == KERN_CPU_GEMM_BLAS_THREADS) { /* for benchmarks only: OpenBLAS's own split */
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, A,
                    lda, B, ldb, beta, C, ldc);
        return;
    }
    if (m == 1 || n == 1) {
        /* A vector on one side: OpenBLAS's sgemv is several times faster than sgemm with m = 1
         * (decode). BLAS gemv may keep a NaN of y when beta = 0 (y·0), so clear y first. */
        if (beta == 0.0f)
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++)
                    C[(int64_t)i * ldc + j] = 0.0f;
        if (m == 1) /* c = op(B)·a, a = op(A)'s row 0 (stride lda when A is transposed) */
            gemv_rows(!tb, n, k, alpha, B, ldb, A, ta ? lda : 1, beta, C, 1);
        else        /* c = op(A)·b, b = op(B)'s column 0 */
            gemv_rows(ta, m, k, alpha, A, lda, B, tb ? 1 : ldb, beta, C, ldc);
        return;
    }
    const int64_t tm = (m + KERN_GEMM_TILE_M - 1) / KERN_GEMM_TILE_M, tn = (n + KERN_GEMM_TILE_N - 1) / KERN_GEMM_TILE_N;
    const int nt = gemm_threads((double)m * n * k, tm * tn);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, 1)
    for (int64_t t = 0; t < tm * tn; t++) {
        int i0 = (int)(t / tn) * KERN_GEMM_TILE_M, j0 = (int)(t % tn) * KERN_GEMM_TILE_N;
        int mi = m - i0 < KERN_GEMM_TILE_M ? m - i0 : KERN_GEMM_TILE_M;
        int nj = n - j0 < KERN_GEMM_TILE_N ? n - j0 : KERN_GEMM_TILE_N;
        const float *a = ta ? A + i0 : A + (int64_t)i0 * lda; /* op(A)'s rows i0.. */
        const float *b = tb ? B + (int64_t)j0 * ldb : B + j0; /* op(B)'s columns j0.. */
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, mi, nj, k, alpha, a,
                    lda, b, ldb, beta, C + (int64_t)i0 * ldc + j0, ldc);
    }
}

/* ---- a narrow B (frozen weights kept in their precision) ------------------------------------ */

KERN_HOT static void widen_i8(float *dst, const int8_t *src, float scale, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)src[i] * scale;
}

void kern_cpu_widen_row(kern_cpu_wmat w, int64_t r, int64_t c0, int64_t n, float *dst)
{
    if (w.dtype == KERN_I8) {
        widen_i8(dst, (const int8_t *)w.data + r * w.ld + c0, w.scale[r], n);
        return;
    }
    fu_err rc = kern_convert_host(dst, KERN_F32, (const uint16_t *)w.data + r * w.ld + c0, w.dtype, (size_t)n);
    (void)rc; /* valid dtypes and pointers: it cannot fail */
}

/* The rows x cols block of M at (r0, c0), widened into w (contiguous, room for rows * cols). */
static void widen_block(kern_cpu_wmat M, int64_t r0, int64_t c0, int64_t rows, int64_t cols, float *w)
{
    for (int64_t r = 0; r < rows; r++)
        kern_cpu_widen_row(M, r0 + r, c0, cols, w + r * cols);
}

void kern_cpu_sgemm_wn(bool ta, bool tb, int m, int n, int k, float alpha, const float *A, int lda, kern_cpu_wmat B,
                       float beta, float *C, int ldc)
{
    pthread_once(&blas_once, blas_one_thread);
    if (m <= 0 || n <= 0)
        return;
    const int64_t brows = tb ? n : k, bcols = tb ? k : n; /* B as stored */
    if (k <= 0 || gemm_mode == KERN_CPU_GEMM_BLAS_THREADS || n == 1) { /* B widened whole, then the f32 path */
        float *w = fu_malloc((size_t)(brows * bcols > 0 ? brows * bcols : 1) * sizeof *w);
        widen_block(B, 0, 0, brows, bcols, w);
        kern_cpu_sgemm(ta, tb, m, n, k, alpha, A, lda, w, (int)(bcols > 0 ? bcols : 1), beta, C, ldc);
        free(w);
        return;
    }
    if (m == 1) { /* decode: the gemv blocks of kern_cpu_sgemm, each widened first */
        if (beta == 0.0f)
            for (int j = 0; j < n; j++)
                C[j] = 0.0f;
        const float *x = A;
        const int incx = ta ? lda : 1;
        int64_t blocks = (n + KERN_GEMV_BLOCK - 1) / KERN_GEMV_BLOCK;
        int nt = gemm_threads((double)n * k, blocks);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            float *w = fu_malloc((size_t)KERN_GEMV_BLOCK * (size_t)k * sizeof *w); /* this thread's widened block */
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                int r0 = (int)(b * KERN_GEMV_BLOCK), nr = n - r0 < KERN_GEMV_BLOCK ? n - r0 : KERN_GEMV_BLOCK;
                if (tb) { /* B [n x k]: c = B·x over B's rows r0.. */
                    widen_block(B, r0, 0, nr, k, w);
                    cblas_sgemv(CblasRowMajor, CblasNoTrans, nr, k, alpha, w, k, x, incx, beta, C + r0, 1);
                } else { /* B [k x n]: c = Bᵀ·x over B's columns r0.. */
                    widen_block(B, 0, r0, k, nr, w);
                    cblas_sgemv(CblasRowMajor, CblasTrans, k, nr, alpha, w, nr, x, incx, beta, C + r0, 1);
                }
            }
            free(w);
        }
        return;
    }
    /* The tiles of kern_cpu_sgemm, the same BLAS call each; each tile of B is widened once whatever m
     * is (narrower slices of B would change OpenBLAS's bits, and with them the equality with the f32
     * path). With at least a row of tiles per thread, the threads widen each column of tiles together
     * into one shared buffer and then share its row tiles (balanced when n has few tiles: 768 columns
     * are a 512 and a 256 tile); with fewer, each thread takes whole columns of tiles. */
    const int64_t tm = (m + KERN_GEMM_TILE_M - 1) / KERN_GEMM_TILE_M, tn = (n + KERN_GEMM_TILE_N - 1) / KERN_GEMM_TILE_N;
    const int nt_rows = gemm_threads((double)m * n * k, tm);
    if (nt_rows > 1 && tm >= nt_rows) {
        float *w = fu_malloc((size_t)KERN_GEMM_TILE_N * (size_t)k * sizeof *w); /* the shared widened tile */
#pragma omp parallel num_threads(nt_rows)
        for (int64_t jt = 0; jt < tn; jt++) {
            const int j0 = (int)jt * KERN_GEMM_TILE_N, nj = n - j0 < KERN_GEMM_TILE_N ? n - j0 : KERN_GEMM_TILE_N;
            const int64_t rows = tb ? nj : k, cols = tb ? k : nj; /* the block of B as stored */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                kern_cpu_widen_row(B, tb ? j0 + r : r, tb ? 0 : j0, cols, w + r * cols);
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < tm; it++) {
                int i0 = (int)it * KERN_GEMM_TILE_M, mi = m - i0 < KERN_GEMM_TILE_M ? m - i0 : KERN_GEMM_TILE_M;
                const float *a = ta ? A + i0 : A + (int64_t)i0 * lda;
                cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, mi, nj, k,
                            alpha, a, lda, w, tb ? k : nj, beta, C + (int64_t)i0 * ldc + j0, ldc);
            } /* the implied barrier: w is free for the next column */
        }
        free(w);
        return;
    }
    const int nt = gemm_threads((double)m * n * k, tn);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *w = fu_malloc((size_t)KERN_GEMM_TILE_N * (size_t)k * sizeof *w); /* this thread's widened tile */
#pragma omp for schedule(dynamic, 1)
        for (int64_t jt = 0; jt < tn; jt++) {
            int j0 = (int)jt * KERN_GEMM_TILE_N, nj = n - j0 < KERN_GEMM_TILE_N ? n - j0 : KERN_GEMM_TILE_N;
            if (tb) /* op(B)'s columns j0..: B's rows j0.. (tb) or its columns j0.. */
                widen_block(B, j0, 0, nj, k, w);
            else
                widen_block(B, 0, j0, k, nj, w);
            for (int64_t it = 0; it < tm; it++) {
                int i0 = (int)it * KERN_GEMM_TILE_M, mi = m - i0 < KERN_GEMM_TILE_M ? m - i0 : KERN_GEMM_TILE_M;
                const float *a = ta ? A + i0 : A + (int64_t)i0 * lda;
                cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, mi, nj, k,
                            alpha, a, lda, w, tb ? k : nj, beta, C + (int64_t)i0 * ldc + j0, ldc);
            }
        }
        free(w);
    }
}
