/* CUDA backend: cuBLAS, loaded (dlopen) when the first CUDA backend is made, never linked. Linked,
 * libcublas and the libcublasLt it needs cost every process that links fu_kernels about 150 MB of
 * resident memory before main() (their relocations): the broker, a CPU peer and each `fusion status`
 * among them, though none of them uses a GPU (docs/CUDA.md "cuBLAS, loaded on first use"). */
#include <dlfcn.h>
#include <pthread.h>

#include "kern_cuda_internal.cuh"

#define KC_STR2(x) #x
#define KC_STR(x) KC_STR2(x)
#define KC_CUBLAS_LIB "libcublas.so." KC_STR(CUBLAS_VER_MAJOR) /* the major version these headers are */

static kc_blas_api g_api;
static bool g_loaded;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* Looks up name in h into *slot; false (logged) when it is not there. */
template <typename F> static bool sym(void *h, const char *name, F *slot)
{
    *slot = (F)dlsym(h, name);
    if (!*slot)
        fu_log(FU_LOG_ERROR, KC_LOG_COMPONENT, "%s has no %s: %s", KC_CUBLAS_LIB, name, dlerror());
    return *slot != NULL;
}

static void load(void)
{
    void *h = dlopen(KC_CUBLAS_LIB, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fu_log(FU_LOG_ERROR, KC_LOG_COMPONENT, "cannot load %s: %s (the CUDA toolkit's cuBLAS %d is needed for a CUDA "
               "device)", KC_CUBLAS_LIB, dlerror(), CUBLAS_VER_MAJOR);
        return;
    }
    bool ok = sym(h, "cublasCreate_v2", &g_api.create);
    ok = sym(h, "cublasDestroy_v2", &g_api.destroy) && ok;
    ok = sym(h, "cublasSetStream_v2", &g_api.set_stream) && ok;
    ok = sym(h, "cublasSetWorkspace_v2", &g_api.set_workspace) && ok;
    ok = sym(h, "cublasSetPointerMode_v2", &g_api.set_pointer_mode) && ok;
    ok = sym(h, "cublasGemmEx", &g_api.gemm_ex) && ok;
    ok = sym(h, "cublasGetStatusName", &g_api.status_name) && ok;
    ok = sym(h, "cublasGetStatusString", &g_api.status_string) && ok;
    if (!ok) {
        dlclose(h);
        return;
    }
    g_loaded = true; /* kept loaded for the process's life */
}

extern "C" fu_err kc_blas_load(const kc_blas_api **out)
{
    pthread_once(&g_once, load);
    *out = g_loaded ? &g_api : NULL;
    return g_loaded ? FU_OK : FU_ECUDA;
}
