/* CPU backend: products with a frozen bitmap-sparse weight (kern_bitmap.h), delegating the
 * forward to SALR's fused/pipelined kernel (kern_salr_spmm) and computing the input gradient by
 * decoding blocks of rows into a dense scratch and multiplying them with OpenBLAS. */
#include <stdlib.h>
#include <string.h>

#include "kern_bitmap.h"
#include "kern_internal.h"
#include "kern_salr.h"

#define SPARSE_DX_BLOCK_ROWS 256 /* rows of W decoded per sgemm in the input gradient */

static fu_err check_handle(const kern_sparse_weight *w)
{
    const kern_bitmap_t *bm = w->handle;
    if (kern_bitmap_rows(bm) != (size_t)w->rows || kern_bitmap_cols(bm) != (size_t)w->cols)
        return FU_EINVAL;
    return FU_OK;
}

fu_err kern_cpu_sparse_matmul(const kern_backend_t *be, const kern_tensor_t *x, const kern_sparse_weight *w,
                              float beta, kern_tensor_t *y)
{
    (void)be;
    FU_TRY(check_handle(w));
    size_t n = (size_t)x->shape[0];
    if (n == 0)
        return FU_OK;
    return kern_salr_spmm(w->handle, x->data, n, y->data, beta != 0.0f, kern_cpu_threads());
}

fu_err kern_cpu_sparse_matmul_dx(const kern_backend_t *be, const kern_tensor_t *dy, const kern_sparse_weight *w,
                                 kern_tensor_t *dx)
{
    (void)be;
    FU_TRY(check_handle(w));
    const int64_t n = dy->shape[0], rows = w->rows, cols = w->cols;
    if (n == 0)
        return FU_OK;
    const int64_t blk = rows < SPARSE_DX_BLOCK_ROWS ? rows : SPARSE_DX_BLOCK_ROWS;
    float *dense = NULL;
    if (posix_memalign((void **)&dense, KERN_ALIGN, (size_t)(blk * cols) * sizeof(float)) != 0)
        return FU_ENOMEM;
    fu_err rc = FU_OK;
    for (int64_t r0 = 0; r0 < rows && rc == FU_OK; r0 += blk) {
        int64_t nr = rows - r0 < blk ? rows - r0 : blk;
        rc = kern_bitmap_decode_rows(w->handle, (size_t)r0, (size_t)nr, dense, (size_t)cols);
        if (rc != FU_OK)
            break;
        /* dX += dY[:, r0:r0+nr] · W[r0:r0+nr, :] (the first block overwrites) */
        kern_cpu_sgemm(false, false, (int)n, (int)cols, (int)nr, 1.0f,
                    (const float *)dy->data + r0, (int)rows, dense, (int)cols, r0 == 0 ? 0.0f : 1.0f,
                    (float *)dx->data, (int)cols);
    }
    free(dense);
    return rc;
}
