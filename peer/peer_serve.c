/* peer_serve: a serving job's stage (docs/SERVE.md "Serving jobs"): a table of sessions, each its
 * own KV cache (dag_session), sampler and token history, and one batched forward per turn over every
 * session whose next positions have arrived (dag_infer_forward_batch).
 *
 * The broker starts a session on every stage (SessionStart: stage 0 gets its tokens, the last stage
 * its sampling) and ends it (SessionEnd). A session's positions then go round as a job of one
 * generation's do (peer_infer.c): stage 0 runs the tokens, each stage sends its rows downstream, the
 * last stage draws the next token and reports it (InferToken.session), and stage 0 gets it back from
 * the broker or over the ring. Every frame of a session carries its number in Envelope.micro_batch.
 *
 * What arrives is queued per session (one input each, its positions and its tokens or rows); when the
 * I/O thread has nothing more for this thread, one forward runs the whole queue. A session whose
 * input comes while one is queued runs the queue first, so a session never skips ahead. */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dag_infer.h"
#include "fu_alloc.h"
#include "fu_log.h"
#include "peer_stage_internal.h"

struct st_session {
    uint32_t id;
    dag_session_t *sess;
    dag_infer_stage inf;
    uint32_t max_tokens;     /* the last stage sends no token past this many generated */
    int32_t *hist;           /* stage 0: the token of each position run */
    size_t hist_cap;
    /* the queued input: positions [pos, pos + rows) */
    bool due;
    uint64_t pos, rows;
    int32_t *tok;            /* stage 0: rows ids */
    float *act;              /* other stages: the frame's rows x w_in_total floats */
};

static st_session *find(stage_t *s, uint32_t id)
{
    for (size_t i = 0; i < s->n_ss; i++)
        if (s->ss[i].id == id)
            return &s->ss[i];
    return NULL;
}

static void drop_input(st_session *q)
{
    q->due = false;
    free(q->tok);
    free(q->act);
    q->tok = NULL;
    q->act = NULL;
}

static void session_free(st_session *q)
{
    drop_input(q);
    dag_exec_session_destroy(&q->sess);
    free(q->hist);
}

static void session_remove(stage_t *s, st_session *q)
{
    session_free(q);
    size_t i = (size_t)(q - s->ss);
    memmove(&s->ss[i], &s->ss[i + 1], (s->n_ss - i - 1) * sizeof *s->ss);
    s->n_ss--;
}

void stage_serve_clear(stage_t *s)
{
    for (size_t i = 0; i < s->n_ss; i++)
        session_free(&s->ss[i]);
    free(s->ss);
    s->ss = NULL;
    s->n_ss = s->cap_ss = 0;
}

/* Stage 0: remembers the tokens of q's queued positions (the session's inputs, as run). */
static void hist_keep(st_session *q)
{
    if (q->pos + q->rows > q->hist_cap) {
        size_t cap = q->hist_cap ? q->hist_cap : 256;
        while (cap < q->pos + q->rows)
            cap *= 2;
        q->hist = fu_realloc(q->hist, cap * sizeof *q->hist);
        q->hist_cap = cap;
    }
    memcpy(q->hist + q->pos, q->tok, q->rows * sizeof *q->tok);
}

/* Queues positions [pos, pos + rows) of q: tok (stage 0) or act, taken. A queued input runs first. */
static void queue_input(stage_t *s, st_session *q, uint64_t pos, uint64_t rows, int32_t *tok, float *act)
{
    if (q->due)
        stage_serve_run(s);
    q = find(s, q->id); /* the run may have ended sessions: the table moved */
    if (!q) {
        free(tok);
        free(act);
        return;
    }
    q->due = true;
    q->pos = pos;
    q->rows = rows;
    q->tok = tok;
    q->act = act;
    if (tok)
        hist_keep(q);
    s->pending_fwd = true;
}

static void serve_error(stage_t *s, uint32_t id, const char *fmt, const char *what)
{
    stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_SESSION_START, fmt, id, what);
}

/* ---- from the broker ---- */

static void on_session_start(stage_t *s, const Fusion__SessionStart *st)
{
    if (!s->active || !s->loaded || st->job_id != s->job_id || st->session == 0)
        return;
    st_session *q = find(s, st->session);
    if (q) /* started again (a failover): from its tokens, as new */
        session_remove(s, q);
    if (stage_is_first(s) && (st->n_tokens == 0 || st->n_tokens > s->ctx_rows)) {
        serve_error(s, st->session, "session %u: %s", "no tokens, or more than this stage's context");
        return;
    }
    if (s->n_ss >= s->spec.sessions) {
        serve_error(s, st->session, "session %u: %s", "over the job's sessions");
        return;
    }
    if (s->n_ss == s->cap_ss) {
        s->cap_ss = s->cap_ss ? 2 * s->cap_ss : 8;
        s->ss = fu_realloc(s->ss, s->cap_ss * sizeof *s->ss);
    }
    q = &s->ss[s->n_ss];
    memset(q, 0, sizeof *q);
    q->id = st->session;
    q->max_tokens = st->max_tokens;
    dag_spec sp = s->spec; /* the job's, with the session's sampling (read by the init only) */
    sp.temperature = st->temperature;
    sp.top_k = st->top_k;
    sp.top_p = st->top_p > 0 ? st->top_p : 1.0;
    sp.seed = st->seed;
    fu_err rc = dag_exec_session_new(s->x, &q->sess);
    if (rc == FU_OK)
        rc = dag_infer_stage_init(&q->inf, s->x, s->g, q->sess, &sp, stage_is_first(s), stage_is_last(s),
                                  st->resume);
    if (rc != FU_OK) {
        dag_exec_session_destroy(&q->sess);
        serve_error(s, st->session, "session %u: %s", fu_strerror(rc));
        return;
    }
    s->n_ss++;
    if (stage_is_first(s)) {
        int32_t *tok = fu_malloc(st->n_tokens * sizeof *tok);
        memcpy(tok, st->tokens, st->n_tokens * sizeof *tok);
        queue_input(s, q, 0, st->n_tokens, tok, NULL);
    }
}

void stage_serve_on_msg(stage_t *s, const wire_msg_t *m)
{
    if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_SESSION_START) {
        on_session_start(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_SESSION_START));
        return;
    }
    const Fusion__SessionEnd *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_SESSION_END);
    st_session *q = e && s->active && e->job_id == s->job_id ? find(s, e->session) : NULL;
    if (q)
        session_remove(s, q);
}

/* Stage 0: token tok for position pos of session q (from the broker, or over the ring). */
static void take_token(stage_t *s, st_session *q, uint64_t pos, int32_t tok, bool ring)
{
    int64_t len = dag_session_len(q->sess);
    uint64_t end = len > 0 ? (uint64_t)len : 0;
    if (q->due)
        end = q->pos + q->rows; /* where the queued input leaves it */
    if (pos < end && pos < q->hist_cap) {
        if (q->hist[pos] == tok || ring)
            return; /* the second copy of a token already taken (or a ring copy: the broker's counts) */
        /* The last stage told stage 0 and the broker different tokens: the broker's copy counts, and
         * the broker hears of it (it moves the last stage; every session starts again from its own
         * history). Tokens come through the broker only from now on. */
        FU_WARN("peer", "job %016" PRIx64 " session %u: token %d for position %" PRIu64 " from the broker, %d from "
                "the last stage", s->job_id, q->id, tok, pos, q->hist[pos]);
        s->ring_in = false;
        Fusion__Error e = FUSION__ERROR__INIT;
        e.code = FUSION__ERROR_CODE__ERR_CONFLICT;
        e.in_reply_to = FUSION__MSG_TYPE__MSG_INFER_TOKEN;
        e.message = (char *)"the last stage sent stage 0 another token than the broker's";
        stage_send_msg(s, FUSION__MSG_TYPE__MSG_ERROR, pos, &e.base);
    } else if (pos != end) {
        return; /* not the next position: a late or early copy */
    }
    int32_t *t = fu_malloc(sizeof *t);
    *t = tok;
    queue_input(s, q, pos, 1, t, NULL);
}

void stage_serve_on_token(stage_t *s, const Fusion__InferToken *it)
{
    if (!s->active || !s->loaded || !stage_is_first(s) || it->job_id != s->job_id)
        return;
    st_session *q = find(s, it->session);
    if (q)
        take_token(s, q, it->position, it->token, false);
}

void stage_serve_on_tensor(stage_t *s, const wire_tensor *t)
{
    st_session *q = find(s, t->meta.micro_batch);
    if (!q || t->meta.type != FUSION__MSG_TYPE__MSG_ACTIVATION || t->meta.ndim != 2 || t->meta.shape[0] <= 0)
        return;
    uint64_t rows = (uint64_t)t->meta.shape[0];
    if (!stage_is_first(s)) {
        if ((uint64_t)t->meta.shape[1] != s->w_in_total || t->meta.dtype != FUSION__DTYPE__DTYPE_F32 ||
            rows > s->ctx_rows || t->len != rows * s->w_in_total * sizeof(float))
            return;
        float *act = fu_malloc(t->len);
        memcpy(act, t->data, t->len);
        queue_input(s, q, t->meta.step, rows, NULL, act);
        return;
    }
    if (!s->ring_in || t->meta.dtype != FUSION__DTYPE__DTYPE_I32 || rows != 1 || t->meta.shape[1] != 1 ||
        t->len != sizeof(int32_t))
        return;
    int32_t tok;
    memcpy(&tok, t->data, sizeof tok);
    take_token(s, q, t->meta.step, tok, true);
}

/* ---- the batched forward ---- */

/* Whether the token the last stage drew for position pos of q ends q's generation. */
static bool ends(const stage_t *s, const st_session *q, uint64_t pos, int32_t tok)
{
    if (pos + 1 - q->inf.prompt_len >= q->max_tokens)
        return true;
    for (size_t i = 0; i < s->n_eos; i++)
        if (tok == s->eos[i])
            return true;
    return false;
}

/* After the batch: session q's rows [off, off + q->rows) of the batch's outputs (out: every cut
 * output's block of total rows, one after the other) downstream, or at the last stage its token. */
static void emit(stage_t *s, st_session *q, const float *out, uint64_t off, uint64_t total)
{
    uint64_t pos = q->pos + q->rows;
    if (!stage_is_last(s)) {
        size_t n = (size_t)(q->rows * s->w_out_total);
        float *f = fu_malloc(n * sizeof *f + 1), *w = f;
        const float *blk = out;
        for (uint32_t c = 0; c < s->n_cut_out; c++) {
            uint64_t width = dag_graph_width(s->g, s->cut_out[c]);
            memcpy(w, blk + off * width, q->rows * width * sizeof *w);
            w += q->rows * width;
            blk += total * width;
        }
        stage_send_tensor(s, FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM, FUSION__MSG_TYPE__MSG_ACTIVATION, q->pos, q->id,
                          FUSION__DTYPE__DTYPE_F32, q->rows, s->w_out_total, (uint8_t *)f, n * sizeof *f);
        return;
    }
    int32_t tok = 0;
    if (dag_infer_sampled(&q->inf, &tok) != FU_OK)
        return;
    if (!ends(s, q, pos, tok)) {
        if (stage_is_first(s)) { /* one stage: the token is its own next input */
            int32_t *t = fu_malloc(sizeof *t);
            *t = tok;
            q->due = true;
            q->pos = pos;
            q->rows = 1;
            q->tok = t;
            hist_keep(q);
            s->pending_fwd = true;
        } else if (s->ring_out) {
            uint8_t *d = fu_malloc(sizeof tok);
            memcpy(d, &tok, sizeof tok);
            stage_send_tensor(s, FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM, FUSION__MSG_TYPE__MSG_ACTIVATION, pos, q->id,
                              FUSION__DTYPE__DTYPE_I32, 1, 1, d, sizeof tok);
        }
    }
    Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
    it.job_id = s->job_id;
    it.session = q->id;
    it.position = pos;
    it.token = tok;
    stage_send_msg(s, FUSION__MSG_TYPE__MSG_INFER_TOKEN, pos, &it.base);
}

void stage_serve_run(stage_t *s)
{
    if (!s->active || !s->loaded || !s->running)
        return;
    /* Stage 0 of a pipeline cuts its sessions into as many groups as there are stages: while one group
     * is computed downstream the next runs here, so every stage has work. A group holds at most
     * ceil(sessions / stages), which keeps the groups as they go round (the next call runs the rest). */
    size_t cap = DAG_INFER_MAX_BATCH;
    if (stage_is_first(s) && s->stage_count > 1) {
        size_t g = (s->n_ss + s->stage_count - 1) / s->stage_count;
        cap = g && g < cap ? g : cap;
    }
    size_t n = 0;
    uint64_t total = 0;
    st_session **qs = fu_malloc((s->n_ss ? s->n_ss : 1) * sizeof *qs);
    for (size_t i = 0; i < s->n_ss && n < cap; i++) {
        st_session *q = &s->ss[i];
        if (!q->due || total + q->rows > s->ctx_rows + s->spec.sessions)
            continue;
        fu_errmsg em = {{0}};
        if (dag_infer_seek(&q->inf, q->pos, &em) != FU_OK) {
            serve_error(s, q->id, "session %u: %s", em.msg);
            drop_input(q);
            continue;
        }
        qs[n++] = q;
        total += q->rows;
    }
    if (n == 0) {
        free(qs);
        return;
    }
    dag_infer_stage **ts = fu_malloc(n * sizeof *ts);
    uint64_t *rows = fu_malloc(n * sizeof *rows);
    int32_t *tok = NULL;
    float *in = NULL;
    size_t n_in = 0;
    if (stage_is_first(s)) {
        tok = fu_malloc(total * sizeof *tok);
        for (size_t i = 0, at = 0; i < n; at += qs[i]->rows, i++)
            memcpy(tok + at, qs[i]->tok, qs[i]->rows * sizeof *tok);
    } else { /* per cut input: the sessions' blocks one after the other */
        n_in = (size_t)(total * s->w_in_total);
        in = fu_malloc(n_in * sizeof *in + 1);
        float *w = in;
        uint64_t coff = 0;
        for (uint32_t c = 0; c < s->n_cut_in; c++) {
            uint64_t width = dag_graph_width(s->g, s->cut_in[c]);
            for (size_t i = 0; i < n; i++) {
                memcpy(w, qs[i]->act + qs[i]->rows * coff, qs[i]->rows * width * sizeof *w);
                w += qs[i]->rows * width;
            }
            coff += width;
        }
    }
    for (size_t i = 0; i < n; i++) {
        ts[i] = &qs[i]->inf;
        rows[i] = qs[i]->rows;
    }
    if (n > s->ss_widest) {
        s->ss_widest = n;
        if (n > 1)
            FU_INFO("peer", "job %016" PRIx64 " stage %u: %zu sessions in one forward (%" PRIu64 " positions)",
                    s->job_id, s->stage_index, n, total);
    }
    fu_errmsg em = {{0}};
    fu_err rc = dag_infer_forward_batch(ts, n, tok, in, n_in, rows, &em);
    free(tok);
    free(in);
    float *out = NULL;
    if (rc == FU_OK && !stage_is_last(s)) {
        size_t no = (size_t)(total * s->w_out_total);
        out = fu_malloc(no * sizeof *out + 1);
        rc = stage_collect_outputs(s, 0, no, out);
    }
    if (rc == FU_ECUDA) {
        stage_fatal(s, rc, "inference forward");
    } else if (rc != FU_OK) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_INFER_TOKEN, "%s",
                         fu_errmsg_text(&em, rc));
        for (size_t i = 0; i < n; i++)
            drop_input(qs[i]);
    } else {
        uint64_t off = 0;
        for (size_t i = 0; i < n; i++) {
            st_session *q = qs[i];
            uint64_t r = q->rows;
            drop_input(q);
            emit(s, q, out, off, total); /* may queue q's next input (one stage) */
            off += r;
        }
    }
    free(out);
    free(ts);
    free(rows);
    free(qs);
    for (size_t i = 0; i < s->n_ss; i++)
        if (s->ss[i].due)
            s->pending_fwd = true;
}
