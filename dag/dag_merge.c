#include "dag_merge.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <cjson/cJSON.h>

#include "dag_model.h"
#include "dag_peft.h"
#include "fu_alloc.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "fu_tokenizer.h"
#include "kern_bitmap.h"

typedef struct {
    const fu_safetensors *st;   /* the base model */
    const fu_safetensors *ast;  /* the adapter, or NULL */
    fu_weight_info *w;          /* the tensors written, in order */
    bool *linear;               /* w[i] is a linear weight (an adapter or a SALR encoding may apply) */
    bool salr;                  /* the model is SALR-pruned */
    bool salr_head;             /* ... with its lm_head too */
    uint32_t r;                 /* the adapter's rank */
    float scale;                /* alpha / r */
    dag_merge_report *rep;
    fu_errmsg *em;
} merge_ctx;

/* w += B·A (scaled) for A [r, in], B [out, r] named <module>.<a> and <module>.<b> in st, when there;
 * *found says whether they were. */
static fu_err add_product(const fu_safetensors *st, const char *prefix, const char *module, const char *an,
                          const char *bn, uint64_t r, float scale, const fu_weight_info *wi, float *w, bool *found,
                          fu_errmsg *em)
{
    char na[DAG_PEFT_NAME_MAX + 64], nb[DAG_PEFT_NAME_MAX + 64];
    snprintf(na, sizeof na, "%s%s.%s", prefix, module, an);
    snprintf(nb, sizeof nb, "%s%s.%s", prefix, module, bn);
    *found = fu_safetensors_get(st, na) || fu_safetensors_get(st, nb);
    if (!*found)
        return FU_OK;
    const uint64_t out = wi->shape[0], in = wi->shape[1];
    if (r == 0) { /* the residual's rank: from the tensor */
        const fu_st_tensor *t = fu_safetensors_get(st, na);
        if (!t || t->ndim != 2)
            return fu_errmsg_set(em, FU_EINVAL, "'%s' is missing or not 2-D", na);
        r = t->shape[0];
    }
    uint64_t sa[2] = {r, in}, sb[2] = {out, r};
    float *A = fu_malloc(r * in * sizeof *A), *B = fu_malloc(out * r * sizeof *B);
    fu_err rc = fu_safetensors_read_f32(st, na, 2, sa, A, r * in, em);
    if (rc == FU_OK)
        rc = fu_safetensors_read_f32(st, nb, 2, sb, B, out * r, em);
    if (rc == FU_OK)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)out, (int)in, (int)r, scale, B, (int)r, A, (int)in,
                    1.0f, w, (int)in);
    else
        rc = fu_errmsg_set(em, FU_EINVAL, "the adapter of '%s' does not fit the model: %s", module, em->msg);
    free(A);
    free(B);
    return rc;
}

/* The dense weight of a SALR linear: its bitmap encoding decoded (or its dense pruned copy). */
static fu_err salr_dense(const fu_safetensors *st, const fu_weight_info *wi, float *w, fu_errmsg *em)
{
    char bn[sizeof wi->name + 16], vn[sizeof wi->name + 16], on[sizeof wi->name + 16];
    snprintf(bn, sizeof bn, "%s.bitmap", wi->name);
    snprintf(vn, sizeof vn, "%s.values", wi->name);
    snprintf(on, sizeof on, "%s.offsets", wi->name);
    const fu_st_tensor *tb = fu_safetensors_get(st, bn), *tv = fu_safetensors_get(st, vn), *to = fu_safetensors_get(st, on);
    if (!tb)
        return fu_safetensors_read_f32(st, wi->name, wi->ndim, wi->shape, w, wi->shape[0] * wi->shape[1], em);
    if (!tv || !to || tb->dtype != FU_ST_U8 || to->dtype != FU_ST_I32 ||
        (tv->dtype != FU_ST_F32 && tv->dtype != FU_ST_F16))
        return fu_errmsg_set(em, FU_EPROTO, "the bitmap-encoded '%s' is incomplete or of the wrong dtypes", wi->name);
    kern_bitmap_t *bm = NULL;
    fu_err rc = kern_bitmap_from_buffers(wi->shape[0], wi->shape[1], tv->dtype == FU_ST_F16 ? KERN_BITMAP_F16
                                                                                           : KERN_BITMAP_F32,
                                         tb->data, tb->nbytes, tv->data, tv->nbytes, to->data, to->nbytes, &bm);
    if (rc == FU_OK)
        rc = kern_bitmap_decode(bm, w, wi->shape[1]);
    kern_bitmap_destroy(&bm);
    return rc == FU_OK ? FU_OK : fu_errmsg_set(em, rc, "the bitmap-encoded '%s' is inconsistent", wi->name);
}

static fu_err fill(void *vctx, size_t i, const fu_st_tensor *t, void *buf, size_t nbytes)
{
    merge_ctx *c = vctx;
    const fu_weight_info *wi = &c->w[i];
    float *w = buf;
    size_t n = nbytes / sizeof(float);
    (void)t;
    bool salr_linear = c->linear[i] && c->salr && (wi->kind != FU_W_LM_HEAD || c->salr_head);
    fu_err rc = salr_linear ? salr_dense(c->st, wi, w, c->em)
                            : fu_safetensors_read_f32(c->st, wi->name, wi->ndim, wi->shape, w, n, c->em);
    if (rc != FU_OK || !c->linear[i])
        return rc;
    char module[sizeof wi->name];
    snprintf(module, sizeof module, "%.*s", (int)(strlen(wi->name) - strlen(".weight")), wi->name);
    bool found = false;
    if (salr_linear) {
        FU_TRY(add_product(c->st, "", module, "salr_A.weight", "salr_B.weight", 0, 1.0f, wi, w, &found, c->em));
        c->rep->densified++;
    }
    if (c->ast && wi->kind != FU_W_LM_HEAD) {
        FU_TRY(add_product(c->ast, DAG_PEFT_PREFIX, module, "lora_A.weight", "lora_B.weight", c->r, c->scale, wi, w,
                           &found, c->em));
        c->rep->merged += found;
    }
    return FU_OK;
}

fu_err dag_model_merge(const char *model_dir, const char *adapter_dir, const char *out_dir, bool force,
                       dag_merge_report *rep, fu_errmsg *em)
{
    dag_merge_report scratch;
    rep = rep ? rep : &scratch;
    memset(rep, 0, sizeof *rep);
    fu_modelcfg cfg;
    FU_TRY(fu_modelcfg_load(model_dir, &cfg, em));
    char *sc = fu_path_join(model_dir, DAG_SALR_CONFIG_FILE);
    bool salr = fu_path_exists(sc);
    free(sc);
    dag_salr_info si = {0};
    if (salr)
        FU_TRY(dag_salr_info_load(model_dir, &si, em));
    if (!adapter_dir && !salr)
        return fu_errmsg_set(em, FU_EINVAL, "nothing to merge: give an adapter (a dense model without one is itself)");
    char *probe = fu_path_join(out_dir, FU_MODELCFG_FILE);
    bool exists = fu_path_exists(probe);
    free(probe);
    if (exists && !force)
        return fu_errmsg_set(em, FU_EEXIST, "'%s' already holds a model (use --force to replace it)", out_dir);
    merge_ctx c = {.rep = rep, .em = em, .salr = salr, .salr_head = si.lm_head};
    fu_safetensors *st = NULL, *ast = NULL;
    fu_err rc = fu_safetensors_open_dir(model_dir, &st, em);
    if (rc == FU_OK && adapter_dir) {
        float alpha = 0;
        uint32_t targets = 0;
        char *ap = fu_path_join(adapter_dir, DAG_PEFT_WEIGHTS_FILE);
        rc = dag_peft_config_load(adapter_dir, &c.r, &alpha, &targets, em);
        if (rc == FU_OK)
            rc = fu_safetensors_open_file(ap, &ast, em);
        free(ap);
        c.scale = c.r ? alpha / (float)c.r : 0.0f;
    }
    if (rc == FU_OK)
        rc = fu_mkdir_p(out_dir, 0755, em);
    size_t n = fu_modelcfg_weight_count(&cfg);
    c.st = st;
    c.ast = ast;
    c.w = fu_calloc(n, sizeof *c.w);
    c.linear = fu_calloc(n, sizeof *c.linear);
    fu_st_tensor *ts = fu_calloc(n, sizeof *ts);
    for (size_t i = 0; rc == FU_OK && i < n; i++) {
        if ((rc = fu_modelcfg_weight(&cfg, i, &c.w[i])) != FU_OK)
            break;
        fu_weight_kind k = c.w[i].kind;
        c.linear[i] = k == FU_W_Q || k == FU_W_K || k == FU_W_V || k == FU_W_O || k == FU_W_GATE || k == FU_W_UP ||
                      k == FU_W_DOWN || k == FU_W_LM_HEAD;
        ts[i].name = c.w[i].name;
        ts[i].dtype = FU_ST_F32;
        ts[i].ndim = c.w[i].ndim;
        ts[i].nelem = 1;
        for (size_t d = 0; d < c.w[i].ndim; d++) {
            ts[i].shape[d] = c.w[i].shape[d];
            ts[i].nelem *= c.w[i].shape[d];
        }
        ts[i].nbytes = ts[i].nelem * sizeof(float);
        rep->bytes += ts[i].nbytes;
    }
    if (rc == FU_OK) {
        char *out = fu_path_join(out_dir, FU_ST_SINGLE_FILE);
        rc = fu_safetensors_write(out, ts, n, NULL, 0, fill, &c, em);
        free(out);
    }
    if (rc == FU_OK && ast && rep->merged == 0)
        rc = fu_errmsg_set(em, FU_EINVAL, "the adapter has no tensor for any linear of this model");
    rep->tensors = n;
    if (rc == FU_OK) {
        snprintf(cfg.torch_dtype, sizeof cfg.torch_dtype, "float32");
        cfg.int8_weights = false; /* an int8 base is written dequantized */
        rc = fu_modelcfg_save(out_dir, &cfg, em);
    }
    if (rc == FU_OK)
        rc = dag_model_copy_tokenizer(model_dir, out_dir, em);
    free(ts);
    free(c.w);
    free(c.linear);
    fu_safetensors_close(&st);
    fu_safetensors_close(&ast);
    return rc;
}
