/* broker_serve: the sessions of serving jobs (docs/SERVE.md "Serving jobs").
 *
 * A serving job is an inference job whose spec says "sessions": S > 0. It is planned and started
 * like any inference job (the stages' memory holds S sessions of "context" positions each) but has
 * no prompt of its own and never finishes by itself: it runs until its owner cancels it. Its owner
 * opens generations in it (SessionOpen); each is a session, numbered from 1, held here in memory
 * (a session is a request, not something to keep across a broker restart):
 *   - the broker tokenizes the prompt, checks it against the job's context, and sends SessionStart to
 *     every stage (stage 0 with the tokens, the last stage with the sampling);
 *   - the last stage reports each token (InferToken.session); the broker keeps the session's text,
 *     decides when it ends (max_tokens, an end-of-sequence id, a stop string) and sends the token on
 *     to stage 0, as for a job of one generation; at the end, SessionEnd to every stage;
 *   - after a failover (StageStart of a new run) every open session is started again with its prompt
 *     and the tokens generated so far (`resume`), as a job of one generation replays its own;
 *   - status requests may be long polls (SessionRef.wait_ms), answered when the text grows;
 *   - a session that ended is kept BROKER_SERVE_KEEP_MS for its last status, then forgotten;
 *   - a job whose spec says "idle_s" is cancelled by the broker once it has been that long without a
 *     session (a gateway that was killed leaves no job holding the peers for ever).
 * Everything here runs on the broker's loop. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_log.h"

#define LOG "serve"
#define BROKER_SERVE_KEEP_MS    60000u      /* an ended session's status stays this long */
#define BROKER_SERVE_WAITERS    4           /* long polls one session holds */
#define BROKER_SERVE_PROMPT_MAX (256u << 10) /* bytes of a prompt's text */
#define BROKER_SERVE_KEEP_MIN   64u         /* ended sessions a job keeps at least; at most 4 x its sessions
                                               when more (the oldest forgotten first, before their 60 s) */

typedef struct {
    uint32_t id;                   /* 1.. */
    Fusion__JobState state;        /* RUNNING, then DONE, FAILED or CANCELED */
    int32_t *tok;                  /* the prompt, then the generated tokens */
    size_t n_prompt, n_gen, cap;
    dag_spec sp;                   /* its sampling, max_tokens and stop strings (an inference spec) */
    char *output;                  /* the text so far */
    char finish[8];                /* DONE: "length" or "stop" */
    char reason[200];              /* FAILED, CANCELED: why */
    uint64_t ended_ms;             /* monotonic time it ended (0: open) */
    broker_waiter w[BROKER_SERVE_WAITERS];
    uint32_t n_w;
} broker_session;

struct broker_serve {
    broker_session *s;
    size_t n, cap;
    uint32_t next_id;
    uint32_t n_open;
    uint64_t idle_since_ms;        /* monotonic time its last session ended (0: one is open) */
};

static broker_session *session_find(broker_serve *sv, uint32_t id)
{
    for (size_t i = 0; sv && i < sv->n; i++)
        if (sv->s[i].id == id)
            return &sv->s[i];
    return NULL;
}

static void session_clear(broker_session *s)
{
    free(s->tok);
    free(s->output);
    dag_spec_clear(&s->sp);
}

void broker_serve_free(broker_serve **svp)
{
    if (!svp || !*svp)
        return;
    broker_serve *sv = *svp;
    for (size_t i = 0; i < sv->n; i++)
        session_clear(&sv->s[i]);
    free(sv->s);
    free(sv);
    *svp = NULL;
}

uint32_t broker_serve_open_count(const broker_job *j)
{
    return j->serve ? j->serve->n_open : 0;
}

/* ---- answers ---- */

static void answer(broker_t *b, const broker_ret *r, const broker_job *j, const broker_session *s)
{
    Fusion__SessionStatus st = FUSION__SESSION_STATUS__INIT;
    st.job_id = j->id64;
    st.session = s->id;
    st.state = s->state;
    st.output = s->output ? s->output : (char *)"";
    st.tokens = (uint32_t)s->n_gen;
    st.prompt_tokens = (uint32_t)s->n_prompt;
    st.finish_reason = (char *)s->finish;
    st.reason = (char *)s->reason;
    st.waiting = (char *)(!s->ended_ms && j->phase != BJ_RUNNING ? (j->reason[0] ? j->reason : "waiting for peers")
                                                                 : "");
    (void)broker_answer(b, r, FUSION__MSG_TYPE__MSG_SESSION_STATUS, &st.base);
}

/* Answers s's held status requests (every one, or due_only those whose wait is over). */
static void wake(broker_t *b, const broker_job *j, broker_session *s, bool due_only)
{
    uint64_t now = broker_now();
    uint32_t kept = 0;
    for (uint32_t i = 0; i < s->n_w; i++) {
        if (due_only && now < s->w[i].deadline_ms)
            s->w[kept++] = s->w[i];
        else
            answer(b, &s->w[i].ret, j, s);
    }
    s->n_w = kept;
}

/* ---- to the stages ---- */

static void to_stages(broker_t *b, const broker_job *j, Fusion__MsgType t, const ProtobufCMessage *body,
                      const ProtobufCMessage *first_body)
{
    for (uint32_t k = 0; k < j->n_stages; k++) {
        broker_peer *p = broker_peer_find(b, j->stages[k].peer);
        if (p && p->live)
            (void)broker_send_peer(b, p, t, j->id64, k == 0 && first_body ? first_body : body);
    }
}

static void send_start(broker_t *b, const broker_job *j, const broker_session *s)
{
    Fusion__SessionStart st = FUSION__SESSION_START__INIT;
    st.job_id = j->id64;
    st.session = s->id;
    st.resume = s->n_gen;
    st.max_tokens = s->sp.max_tokens;
    st.temperature = s->sp.temperature;
    st.top_k = s->sp.top_k;
    st.top_p = s->sp.top_p;
    st.seed = s->sp.seed;
    Fusion__SessionStart first = st; /* stage 0 alone gets the tokens */
    first.n_tokens = s->n_prompt + s->n_gen;
    first.tokens = s->tok;
    to_stages(b, j, FUSION__MSG_TYPE__MSG_SESSION_START, &st.base, &first.base);
}

/* s ends in state with finish ("length", "stop") or reason; the stages free it. */
static void session_end(broker_t *b, broker_job *j, broker_session *s, Fusion__JobState state, const char *finish,
                        const char *reason)
{
    if (s->ended_ms)
        return;
    s->state = state;
    s->ended_ms = broker_now();
    snprintf(s->finish, sizeof s->finish, "%s", finish ? finish : "");
    snprintf(s->reason, sizeof s->reason, "%s", reason ? reason : "");
    broker_utf8_trim(s->reason);
    if (--j->serve->n_open == 0)
        j->serve->idle_since_ms = broker_now();
    if (state == FUSION__JOB_STATE__JOB_STATE_DONE)
        b->tot.sessions_done++;
    else if (state == FUSION__JOB_STATE__JOB_STATE_FAILED)
        b->tot.sessions_failed++;
    else
        b->tot.sessions_closed++;
    Fusion__SessionEnd e = FUSION__SESSION_END__INIT;
    e.job_id = j->id64;
    e.session = s->id;
    if (!j->dead)
        to_stages(b, j, FUSION__MSG_TYPE__MSG_SESSION_END, &e.base, NULL);
    FU_INFO(LOG, "job %s session %u: %s after %zu tokens%s%s", j->id, s->id,
            state == FUSION__JOB_STATE__JOB_STATE_DONE ? "done" : "ended", s->n_gen, s->reason[0] ? ": " : "",
            s->reason);
    wake(b, j, s, false);
}

void broker_serve_started(broker_t *b, broker_job *j)
{
    if (!j->serve)
        return;
    size_t n = 0, gen = 0;
    for (size_t i = 0; i < j->serve->n; i++)
        if (!j->serve->s[i].ended_ms) {
            send_start(b, j, &j->serve->s[i]);
            n++;
            gen += j->serve->s[i].n_gen;
        }
    if (n)
        FU_INFO(LOG, "job %s: %zu open sessions started again on the new stages (%zu tokens generated so far)", j->id,
                n, gen);
}

void broker_serve_ended(broker_t *b, broker_job *j, const char *why)
{
    if (!j->serve)
        return;
    for (size_t i = 0; i < j->serve->n; i++)
        session_end(b, j, &j->serve->s[i], FUSION__JOB_STATE__JOB_STATE_CANCELED, NULL, why);
}

/* Whether serving job j has been without a session for longer than its spec's idle_s, counted from
 * its last session's end, else from its start (j->progress_ms: its StageStart, or its first open). */
static bool idle_too_long(const broker_job *j, uint64_t now)
{
    if (!j->spec.sessions || !j->spec.idle_s || j->dead || j->phase != BJ_RUNNING ||
        (j->serve && j->serve->n_open))
        return false;
    uint64_t since = j->serve && j->serve->idle_since_ms ? j->serve->idle_since_ms : j->progress_ms;
    return now > since && now - since > (uint64_t)j->spec.idle_s * 1000u;
}

void broker_serve_sweep(broker_t *b, broker_job *j)
{
    uint64_t now = broker_now();
    if (idle_too_long(j, now)) {
        char why[96];
        snprintf(why, sizeof why, "no session for %u s (its idle_s)", j->spec.idle_s);
        broker_job_retire(b, j, why); /* the peers it held go back to the pool */
        return;
    }
    broker_serve *sv = j->serve;
    if (!sv)
        return;
    size_t w = 0;
    for (size_t i = 0; i < sv->n; i++) {
        broker_session *s = &sv->s[i];
        wake(b, j, s, true);
        if (s->ended_ms && now - s->ended_ms > BROKER_SERVE_KEEP_MS && !s->n_w) {
            session_clear(s);
            continue;
        }
        sv->s[w++] = *s;
    }
    sv->n = w;
}

/* ---- the last stage's tokens ---- */

void broker_serve_on_token(broker_t *b, broker_job *j, const wire_msg_t *msg, const Fusion__InferToken *t)
{
    broker_session *s = session_find(j->serve, t->session);
    if (!s || s->ended_ms)
        return; /* a token in flight when the session ended */
    size_t vocab = dag_graph_dims(j->graph)->vocab_size;
    uint64_t expect = s->n_prompt + s->n_gen;
    if (t->token < 0 || (size_t)t->token >= vocab || t->position > expect) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "InferToken: token %d outside the vocabulary or position %" PRIu64 " of session %u not the "
                           "next (%" PRIu64 ")", t->token, t->position, s->id, expect);
        return;
    }
    j->progress_ms = broker_now();
    j->stepped = true;
    j->after_restart = false;
    if (t->position < expect)
        return; /* a replay after a recovery: we have it already */
    if (s->n_prompt + s->n_gen == s->cap) {
        s->cap *= 2;
        s->tok = fu_realloc(s->tok, s->cap * sizeof *s->tok);
    }
    s->tok[s->n_prompt + s->n_gen++] = t->token;
    b->tot.generated_tokens++;
    j->retries = 0;
    char *text = NULL;
    size_t tl = 0;
    bool ends = false;
    if (broker_gen_text(j, &s->sp, s->tok + s->n_prompt, s->n_gen, &ends, &text, &tl) != FU_OK) {
        session_end(b, j, s, FUSION__JOB_STATE__JOB_STATE_FAILED, NULL, "the generated tokens cannot be decoded");
        return;
    }
    wire_utf8_clean(text, tl); /* SessionStatus.output is a string */
    free(s->output);
    s->output = text;
    if (ends) {
        session_end(b, j, s, FUSION__JOB_STATE__JOB_STATE_DONE, s->n_gen >= s->sp.max_tokens ? "length" : "stop", NULL);
        return;
    }
    wake(b, j, s, false);
    broker_token_to_first(b, j, s->id, t->position, t->token);
}

/* ---- the client's requests ---- */

/* The running serving job of msg's sender named id64; answers Error and gives NULL when none. */
static broker_job *own_serving(broker_t *b, const wire_msg_t *msg, uint64_t id64)
{
    broker_job *j = broker_job_find64(b, id64);
    if (!j || strcmp(j->owner, wire_msg_user_id(msg)) != 0) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "no serving job %016" PRIx64 " among your running jobs (`fusion status` lists them)", id64);
        return NULL;
    }
    if (!j->spec.sessions || j->kind != DB_JOB_INFER) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "job %s is no serving job: submit one with `fusion submit infer --sessions N`", j->id);
        return NULL;
    }
    if (!j->serve)
        j->serve = fu_calloc(1, sizeof *j->serve);
    return j;
}

/* The session's spec from what SessionOpen asks: the job's defaults, its own values where given. */
static fu_err open_spec(const broker_job *j, const Fusion__SessionOpen *o, size_t n_prompt, dag_spec *sp,
                        fu_errmsg *em)
{
    dag_spec_init(sp, DAG_JOB_INFER);
    sp->max_tokens = o->max_tokens ? o->max_tokens : j->spec.max_tokens;
    sp->temperature = o->temperature;
    sp->top_k = o->top_k;
    sp->top_p = o->top_p > 0 ? o->top_p : 1.0;
    sp->seed = o->seed;
    if (o->n_stop > DAG_SPEC_MAX_STOP)
        return fu_errmsg_set(em, FU_EINVAL, "SessionOpen: at most %d stop strings", DAG_SPEC_MAX_STOP);
    for (size_t i = 0; i < o->n_stop; i++) {
        size_t l = o->stop[i] ? strlen(o->stop[i]) : 0;
        if (l == 0 || l > DAG_SPEC_STOP_LEN)
            return fu_errmsg_set(em, FU_EINVAL, "SessionOpen: stop strings are 1 to %d bytes", DAG_SPEC_STOP_LEN);
        memcpy(sp->stop[sp->n_stop++], o->stop[i], l + 1);
    }
    FU_TRY(dag_spec_check(sp, em));
    uint32_t ctx = j->spec.context ? j->spec.context : DAG_SPEC_CONTEXT;
    if (n_prompt == 0)
        return fu_errmsg_set(em, FU_EINVAL, "SessionOpen: the prompt is empty");
    if (n_prompt + sp->max_tokens > ctx)
        return fu_errmsg_set(em, FU_EINVAL,
                             "SessionOpen: a prompt of %zu tokens and %u to generate do not fit the job's context of "
                             "%u positions", n_prompt, sp->max_tokens, ctx);
    return FU_OK;
}

/* Keeps a job's ended sessions to BROKER_SERVE_KEEP_MIN, or 4 x its sessions: a client that opens
 * and closes sessions quickly cannot make the broker hold their texts for the whole 60 s. The
 * oldest ended session without a long poll on it goes first. */
static void forget_ended(broker_job *j)
{
    broker_serve *sv = j->serve;
    size_t keep = 4u * j->spec.sessions > BROKER_SERVE_KEEP_MIN ? 4u * j->spec.sessions : BROKER_SERVE_KEEP_MIN;
    while (sv->n - sv->n_open >= keep) {
        size_t old = sv->n;
        for (size_t i = 0; i < sv->n; i++)
            if (sv->s[i].ended_ms && !sv->s[i].n_w && (old == sv->n || sv->s[i].ended_ms < sv->s[old].ended_ms))
                old = i;
        if (old == sv->n)
            return; /* each has a long poll on it: they are answered within 2 s */
        session_clear(&sv->s[old]);
        memmove(&sv->s[old], &sv->s[old + 1], (sv->n - old - 1) * sizeof *sv->s);
        sv->n--;
    }
}

void broker_on_session_open(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__SessionOpen *o = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_SESSION_OPEN);
    broker_job *j = o ? own_serving(b, msg, o->job_id) : NULL;
    if (!j)
        return;
    if (j->serve->n_open >= j->spec.sessions) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                           "job %s holds %u sessions already, its most: retry when one ends", j->id, j->spec.sessions);
        return;
    }
    uint32_t retry = 0;
    if (!broker_quota_take(b->session_quota, j->owner, broker_now(), &retry)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                           "you opened %u sessions in the last minute, the most this broker takes: open again in %u s",
                           b->cfg.sessions_per_min, retry);
        return;
    }
    if (o->prompt.len > BROKER_SERVE_PROMPT_MAX || o->n_prompt_tokens > DAG_SPEC_MAX_PROMPT) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_TOO_LARGE, "SessionOpen: the prompt is over %u bytes or %u "
                           "tokens", BROKER_SERVE_PROMPT_MAX, DAG_SPEC_MAX_PROMPT);
        return;
    }
    if (!o->n_prompt_tokens && !o->prompt.len) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "SessionOpen: the prompt is empty");
        return;
    }
    fu_errmsg em = {{0}};
    int32_t *ids = NULL;
    size_t n = 0;
    size_t vocab = dag_graph_dims(j->graph)->vocab_size;
    if (o->n_prompt_tokens) {
        ids = fu_malloc(o->n_prompt_tokens * sizeof *ids);
        for (size_t i = 0; i < o->n_prompt_tokens; i++) {
            if (o->prompt_tokens[i] < 0 || (size_t)o->prompt_tokens[i] >= vocab) {
                free(ids);
                broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                                   "SessionOpen: prompt_tokens must hold ids between 0 and %zu", vocab - 1);
                return;
            }
            ids[n++] = o->prompt_tokens[i];
        }
    } else if (fu_tokenizer_encode(j->tok, (const char *)o->prompt.data, o->prompt.len, &ids, &n, &em) != FU_OK) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "SessionOpen: the prompt: %s", em.msg);
        return;
    }
    forget_ended(j);
    broker_serve *sv = j->serve;
    if (sv->n == sv->cap) {
        sv->cap = sv->cap ? 2 * sv->cap : 8;
        sv->s = fu_realloc(sv->s, sv->cap * sizeof *sv->s);
    }
    broker_session *s = &sv->s[sv->n];
    memset(s, 0, sizeof *s);
    if (open_spec(j, o, n, &s->sp, &em) != FU_OK) {
        dag_spec_clear(&s->sp);
        free(ids);
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "%s", em.msg);
        return;
    }
    sv->n++;
    b->tot.sessions_opened++;
    s->id = ++sv->next_id;
    s->state = FUSION__JOB_STATE__JOB_STATE_RUNNING;
    s->cap = n + s->sp.max_tokens + 1;
    s->tok = fu_realloc(ids, s->cap * sizeof *s->tok);
    s->n_prompt = n;
    if (sv->n_open++ == 0) {
        j->progress_ms = broker_now(); /* an idle job's step deadline counts from its first session */
        sv->idle_since_ms = 0;
    }
    FU_INFO(LOG, "job %s session %u: opened (%zu prompt tokens, at most %u to generate)", j->id, s->id, n,
            s->sp.max_tokens);
    if (j->phase == BJ_RUNNING)
        send_start(b, j, s); /* else when the job's stages start (broker_serve_started) */
    broker_ret r;
    broker_ret_of(msg, &r);
    answer(b, &r, j, s);
}

void broker_on_session_status(broker_t *b, const wire_msg_t *msg, bool close)
{
    const Fusion__SessionRef *r = wire_msg_body_as(msg, close ? FUSION__MSG_TYPE__MSG_SESSION_CLOSE
                                                               : FUSION__MSG_TYPE__MSG_SESSION_STATUS_REQ);
    broker_job *j = r ? own_serving(b, msg, r->job_id) : NULL;
    broker_session *s = j ? session_find(j->serve, r->session) : NULL;
    if (j && !s) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "job %s has no session %u (an ended session is kept %u s)", j->id, r->session,
                           BROKER_SERVE_KEEP_MS / 1000);
        return;
    }
    if (!s)
        return;
    if (close)
        session_end(b, j, s, FUSION__JOB_STATE__JOB_STATE_CANCELED, NULL, "closed by its owner");
    size_t len = s->output ? strlen(s->output) : 0;
    if (!close && r->wait_ms && !s->ended_ms && len == r->known_output_len && s->n_w < BROKER_SERVE_WAITERS) {
        broker_waiter *w = &s->w[s->n_w++];
        broker_ret_of(msg, &w->ret);
        uint32_t wait = r->wait_ms < BROKER_WAIT_MAX_MS ? r->wait_ms : BROKER_WAIT_MAX_MS;
        w->deadline_ms = broker_now() + wait;
        return;
    }
    broker_ret ret;
    broker_ret_of(msg, &ret);
    answer(b, &ret, j, s);
}
