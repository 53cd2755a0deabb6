/* peer_infer: an inference stage's work on the compute thread (peer_stage.c holds the lifecycle):
 * the messages in and out around the generation step of dag_infer, which owns the session's
 * positions, the sampler's counter, the inputs, the forward and the sampled token, as for
 * `fusion run infer` (docs/PEER.md "Inference"). */
#include <inttypes.h>
#include <stdint.h>

#include "dag_infer.h"
#include "peer_stage_internal.h"

/* After a forward that consumed positions [p, p+rows): the outputs downstream, or at the last stage
 * the sampled token (and the logits when the spec asks) as InferToken. */
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
    if ((rc = dag_infer_sampled(&s->infer, &tok)) != FU_OK) {
        stage_exec_failed(s, rc, "sampling");
        return;
    }
    Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
    it.job_id = s->job_id;
    it.position = p + rows;
    it.token = tok;
    const float *lg = NULL;
    size_t nf = 0;
    if (s->spec.dump_logits && dag_infer_logits(&s->infer, &lg, &nf) == FU_OK && lg) {
        it.logits.data = (uint8_t *)lg;
        it.logits.len = nf * sizeof(float);
    }
    stage_send_msg(s, FUSION__MSG_TYPE__MSG_INFER_TOKEN, p + rows, &it.base);
}

void stage_infer_forward(stage_t *s, uint64_t p, const int32_t *tokens, const float *act, uint64_t rows)
{
    fu_errmsg em = {{0}};
    fu_err rc;
    if ((rc = dag_infer_seek(&s->infer, p, &em)) != FU_OK) {
        if (rc == FU_EPROTO) /* a gap */
            stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_INFER_TOKEN, "%s", em.msg);
        else
            stage_exec_failed(s, rc, "session truncate");
        return;
    }
    /* act: the frame stage_on_tensor checked, rows x w_in_total floats. */
    size_t n = act ? (size_t)(rows * s->w_in_total) : 0;
    if ((rc = dag_infer_forward(&s->infer, tokens, act, n, rows, &em)) != FU_OK) {
        if (rc == FU_ECUDA)
            stage_fatal(s, rc, "inference forward");
        else
            stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_INFER_TOKEN, "%s", em.msg);
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
