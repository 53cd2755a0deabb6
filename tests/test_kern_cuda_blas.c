/* cuBLAS is loaded on first use, not linked (kernels/cuda/kern_cuda_blas.cu). On any machine with
 * the CUDA toolkit, GPU or not: a program linking fu_kernels (this one) starts without libcublas
 * mapped (so no 150 MB of its relocations before main), and the library these headers name then
 * loads with every function the backend calls (a misspelt or versioned-away symbol would otherwise
 * show only on a GPU's first run). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "fu_err.h"

typedef struct kc_blas_api kc_blas_api; /* opaque here (kern_cuda_internal.cuh) */
fu_err kc_blas_load(const kc_blas_api **out);

/* Whether libcublas is mapped into this process now. */
static bool cublas_mapped(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    assert_non_null(f);
    char line[1024];
    bool mapped = false;
    while (fgets(line, sizeof line, f))
        mapped |= strstr(line, "libcublas") != NULL;
    fclose(f);
    return mapped;
}

static void test_kern_cuda_blas_loaded_on_first_use(void **state)
{
    (void)state;
    assert_false(cublas_mapped()); /* not linked */
    const kc_blas_api *api = NULL;
    assert_int_equal(kc_blas_load(&api), FU_OK);
    assert_non_null(api);
    assert_true(cublas_mapped());
    const kc_blas_api *again = NULL;
    assert_int_equal(kc_blas_load(&again), FU_OK); /* once per process */
    assert_ptr_equal(api, again);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_cuda_blas_loaded_on_first_use),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
