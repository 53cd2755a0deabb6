/* peer_infer: an inference stage's work on the compute thread (peer_stage.c holds the lifecycle):
 * one session (KV cache) per job, forwards of new positions (stage 0 from tokens, others from the
 * upstream's activation; a replay truncates the session first), and at the last stage the sampled
 * token reported as InferToken (docs/PEER.md "Inference"). */
#include <inttypes.h>
#include <stdint.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "fu_log.h"
#include "peer_stage_internal.h"

static void set_sampling(stage_t *s, uint64_t counter)
{
    kern_sample_params sp = {.temperature = (float)s->spec.temperature, .top_k = (int)s->spec.top_k,
                             .top_p = (float)s->spec.top_p, .seed = s->spec.seed};
    dag_exec_set_sampling(s->x, &sp, counter);
}

/* After a forward that consumed positions [p, p+rows): the last stage samples and reports. */
static void infer_emit(stage_t *s, uint64_t p, uint64_t rows)
{
    fu_err rc;
    if (!stage_is_last(s)) {
        rc = stage_send_outputs(s, 0, p, 0, rows);
        if (rc != FU_OK)
            stage_exec_failed(s, rc, "reading the stage output");
        return;
    }
    int32_t tok = 0;
    if ((rc = dag_exec_sampled(s->x, 0, &tok)) != FU_OK) {
        stage_exec_failed(s, rc, "sampling");
        return;
    }
    Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
    it.job_id = s->job_id;
    it.position = p + rows;
    it.token = tok;
    const float *lg = NULL;
    size_t nf = 0;
    if (s->spec.dump_logits && s->lm_node != UINT32_MAX &&
        dag_exec_get_output(s->x, 0, s->lm_node, &lg, &nf) == FU_OK && lg) {
        it.logits.data = (uint8_t *)lg;
        it.logits.len = nf * sizeof(float);
    }
    stage_send_msg(s, FUSION__MSG_TYPE__MSG_INFER_TOKEN, p + rows, &it.base);
}

/* Runs rows new positions starting at p (tokens for stage 0, else the upstream's activation). */
void stage_infer_forward(stage_t *s, uint64_t p, const int32_t *tokens, const float *act, uint64_t rows)
{
    int64_t have = dag_session_len(s->sess);
    if ((uint64_t)have > p) {
        fu_err rc = dag_session_truncate(s->sess, (int64_t)p); /* a replay after a failover */
        if (rc != FU_OK) {
            stage_exec_failed(s, rc, "session truncate");
            return;
        }
    } else if ((uint64_t)have < p) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_INFER_TOKEN,
                         "position %" PRIu64 " comes before this stage has positions %" PRId64 "..%" PRIu64
                         " (replay from 0 to rebuild the cache)", p, have, p);
        return;
    }
    if (p == 0 && !stage_is_first(s))
        s->prompt_len = rows > s->resume_step ? rows - s->resume_step : 0; /* see on_start (peer_stage.c) */
    if (stage_is_last(s))
        set_sampling(s, p + rows >= s->prompt_len ? p + rows - s->prompt_len : 0);
    fu_err rc = dag_exec_set_tokens(s->x, 0, tokens, NULL, 1, (uint32_t)rows);
    size_t off = 0;
    for (uint32_t i = 0; i < s->n_cut_in && rc == FU_OK && act; i++) {
        size_t n = (size_t)(rows * dag_graph_width(s->g, s->cut_in[i]));
        rc = dag_exec_set_input(s->x, 0, s->cut_in[i], act + off, n);
        off += n;
    }
    if (rc == FU_OK)
        rc = dag_exec_forward(s->x, 0);
    if (rc != FU_OK) {
        if (rc == FU_ECUDA)
            stage_fatal(s, rc, "inference forward");
        else
            stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_INFER_TOKEN,
                             "inference forward at position %" PRIu64 " failed: %s", p, fu_strerror(rc));
        return;
    }
    infer_emit(s, p, rows);
}

void stage_on_infer_token(stage_t *s, const Fusion__InferToken *it)
{
    if (!s->active || !s->loaded || !stage_is_infer(s) || !stage_is_first(s) || it->job_id != s->job_id)
        return;
    int32_t tok = it->token;
    /* The token at `position` is the input of that position. */
    stage_infer_forward(s, it->position, &tok, NULL, 1);
}
