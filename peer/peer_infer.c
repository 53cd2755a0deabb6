/* peer_infer: an inference stage's work on the compute thread (peer_stage.c holds the lifecycle):
 * the messages in and out around the generation step of dag_infer, which owns the session's
 * positions, the sampler's counter, the inputs, the forward and the sampled token, as for
 * `fusion run infer` (docs/PEER.md "Inference").
 *
 * The token path. The last stage reports each token to the broker (InferToken), which decides when
 * the generation ends and sends the token on to stage 0. Where the ring is closed (fusion.proto
 * LinkRole) the last stage also sends it straight to stage 0, one hop, and one stage feeds it back to
 * itself: whichever copy comes first is taken, and the other must agree with it. The broker's copy
 * is the word that counts: when the two differ stage 0 goes on with the broker's and says so
 * (ERR_CONFLICT), and the broker stops trusting the last stage. */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dag_infer.h"
#include "fu_alloc.h"
#include "fu_log.h"
#include "peer_faults.h"
#include "peer_stage_internal.h"

/* Whether the token tok the last stage drew for position pos ends the generation (the job's
 * max_tokens, or an end-of-sequence id): then nobody feeds it back. */
static bool infer_ends(const stage_t *s, uint64_t pos, int32_t tok)
{
    if (pos + 1 - s->infer.prompt_len >= s->spec.max_tokens)
        return true;
    for (size_t i = 0; i < s->n_eos; i++)
        if (tok == s->eos[i])
            return true;
    return false;
}

/* The last stage: tok for position pos straight to stage 0 over the ring. */
static void send_ring_token(stage_t *s, uint64_t pos, int32_t tok)
{
    /* FAULT INJECTION FOR TESTS ONLY (peer_faults.h): a last stage telling stage 0 another token */
    if (peer_fault_corrupt_now() == PEER_CORRUPT_RING)
        tok = (int32_t)(((size_t)tok + 1) % dag_graph_dims(s->g)->vocab_size);
    uint8_t *data = fu_malloc(sizeof tok);
    memcpy(data, &tok, sizeof tok); /* little-endian hosts only (wire_tensor) */
    stage_send_tensor(s, FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM, FUSION__MSG_TYPE__MSG_ACTIVATION, pos, 0,
                      FUSION__DTYPE__DTYPE_I32, 1, 1, data, sizeof tok);
}

/* After a forward that consumed positions [p, p+rows): the outputs downstream, or at the last stage
 * the sampled token: to stage 0 (the ring, or this stage itself), then to the broker as InferToken
 * (with the logits when the spec asks). */
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
    uint64_t pos = p + rows;
    if (!infer_ends(s, pos, tok)) {
        if (stage_is_first(s)) { /* one stage: the next forward, once the pipe has nothing waiting */
            s->next_pos = pos;
            s->next_tok = tok;
            s->pending_fwd = true;
        } else if (s->ring_out) {
            send_ring_token(s, pos, tok);
        }
    }
    Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
    it.job_id = s->job_id;
    it.position = pos;
    it.token = tok;
    const float *lg = NULL;
    size_t nf = 0;
    if (s->spec.dump_logits && dag_infer_logits(&s->infer, &lg, &nf) == FU_OK && lg) {
        it.logits.data = (uint8_t *)lg;
        it.logits.len = nf * sizeof(float);
    }
    stage_send_msg(s, FUSION__MSG_TYPE__MSG_INFER_TOKEN, pos, &it.base);
}

/* Stage 0: remembers the tokens of positions [p, p+rows), the session's inputs. */
static void hist_keep(stage_t *s, uint64_t p, const int32_t *tokens, uint64_t rows)
{
    if (p + rows > s->hist_cap) {
        size_t cap = s->hist_cap ? s->hist_cap : 256;
        while (cap < p + rows)
            cap *= 2;
        s->hist = fu_realloc(s->hist, cap * sizeof *s->hist);
        s->hist_cap = cap;
    }
    memcpy(s->hist + p, tokens, rows * sizeof *tokens);
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
    if (tokens)
        hist_keep(s, p, tokens, rows);
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

/* Stage 0: the token tok for position pos, from the broker or (ring) from the last stage or this
 * stage itself. The next position's token is run; a token of a position already run must be the one
 * it ran with. */
static void infer_token(stage_t *s, uint64_t pos, int32_t tok, bool ring)
{
    int64_t len = dag_session_len(s->sess);
    uint64_t end = len > 0 ? (uint64_t)len : 0;
    if (pos < end && pos < s->hist_cap) {
        int32_t had = s->hist[pos];
        if (had == tok)
            return; /* the second copy of a token already taken */
        if (!s->ring_in) { /* one stage: its own token against the broker's; cannot differ but for a bug */
            FU_WARN("peer", "job %016" PRIx64 ": the broker's token %d for position %" PRIu64 " is not the %d "
                    "sampled here: going back to it", s->job_id, tok, pos, had);
        } else {
            /* The last stage told stage 0 and the broker different tokens: the broker's copy counts. */
            FU_WARN("peer", "job %016" PRIx64 ": token %d for position %" PRIu64 " from the %s, %d from the %s",
                    s->job_id, ring ? tok : had, pos, "last stage", ring ? had : tok, "broker");
            Fusion__Error e = FUSION__ERROR__INIT;
            e.code = FUSION__ERROR_CODE__ERR_CONFLICT;
            e.in_reply_to = FUSION__MSG_TYPE__MSG_INFER_TOKEN;
            e.message = (char *)"the last stage sent stage 0 another token than the broker's";
            stage_send_msg(s, FUSION__MSG_TYPE__MSG_ERROR, pos, &e.base);
        }
        if (ring)
            return; /* the broker's copy was taken already */
    } else if (ring && pos != end) {
        FU_DEBUG("peer", "job %016" PRIx64 ": ring token for position %" PRIu64 " at session length %" PRIu64
                 ": dropped", s->job_id, pos, end);
        return; /* not the next position: only the broker's copy may rewind or be refused as a gap */
    }
    if (ring && s->ring_in && s->ring_taken++ == 0)
        FU_INFO("peer", "job %016" PRIx64 " stage 0: tokens come straight from the last stage", s->job_id);
    /* The token at `position` is the input of that position. */
    stage_infer_forward(s, pos, &tok, NULL, 1);
}

void stage_on_infer_token(stage_t *s, const Fusion__InferToken *it)
{
    if (!s->active || !s->loaded || !stage_is_infer(s) || !stage_is_first(s) || it->job_id != s->job_id)
        return;
    infer_token(s, it->position, it->token, false);
}

void stage_infer_next(stage_t *s)
{
    if (s->active && s->loaded && s->running && stage_is_infer(s) && stage_is_first(s) && stage_is_last(s))
        infer_token(s, s->next_pos, s->next_tok, true);
}

void stage_infer_on_tensor(stage_t *s, const wire_tensor *t)
{
    if (t->meta.type != FUSION__MSG_TYPE__MSG_ACTIVATION || t->meta.ndim != 2 || t->meta.shape[0] <= 0)
        return;
    if (!stage_is_first(s)) {
        if ((uint64_t)t->meta.shape[1] == s->w_in_total && t->meta.dtype == FUSION__DTYPE__DTYPE_F32)
            stage_infer_forward(s, t->meta.step, NULL, (const float *)t->data, (uint64_t)t->meta.shape[0]);
        return;
    }
    if (!s->ring_in || !s->running || t->meta.dtype != FUSION__DTYPE__DTYPE_I32 || t->meta.shape[0] != 1 ||
        t->meta.shape[1] != 1 || t->len != sizeof(int32_t)) {
        FU_DEBUG("peer", "job %016" PRIx64 " stage 0: a frame from upstream that is no ring token: dropped",
                 s->job_id);
        return;
    }
    int32_t tok;
    memcpy(&tok, t->data, sizeof tok);
    infer_token(s, t->meta.step, tok, true);
}
