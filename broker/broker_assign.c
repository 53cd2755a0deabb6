/* broker_assign: assigning and starting a job's stages (StageAssign with each stage's neighbours,
 * the inference ring): the normal path after a plan, and the one failover and recovery take. */
#include <stdint.h>
#include <string.h>

#include "broker_internal.h"

/* Whether inference job j closes its ring (LinkRole): the last stage sends each token straight to
 * stage 0, when both reach each other without the broker and neither has given the broker reason to
 * doubt what it sends there. */
static bool job_ring(broker_t *b, const broker_job *j)
{
    if (j->kind != DB_JOB_INFER || j->n_stages < 2 || j->no_ring)
        return false;
    const broker_peer *p0 = broker_peer_find(b, j->stages[0].peer);
    const broker_peer *pl = broker_peer_find(b, j->stages[j->n_stages - 1].peer);
    return p0 && pl && !p0->relay && !pl->relay && p0->endpoint[0] && pl->endpoint[0];
}

fu_err broker_send_assign(broker_t *b, broker_job *j, uint32_t s, broker_peer *p, bool backup)
{
    Fusion__StageAssign a = FUSION__STAGE_ASSIGN__INIT;
    Fusion__Neighbour nb[2];
    Fusion__Neighbour *nbp[2];
    uint8_t keys[2][WIRE_KEY_BYTES];
    size_t nn = 0;
    bool ring = job_ring(b, j);
    for (int d = -1; d <= 1; d += 2) {
        int64_t o = (int64_t)s + d;
        if (ring && o < 0)
            o = (int64_t)j->n_stages - 1; /* stage 0's upstream: the last stage */
        else if (ring && o == (int64_t)j->n_stages)
            o = 0; /* the last stage's downstream: stage 0 */
        if (o < 0 || o >= (int64_t)j->n_stages)
            continue;
        broker_peer *q = broker_peer_find(b, j->stages[o].peer);
        fusion__neighbour__init(&nb[nn]);
        nb[nn].role = d < 0 ? FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM : FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM;
        nb[nn].stage_index = (uint32_t)o;
        if (q && wire_key_from_z85(q->pk, keys[nn]) == FU_OK) {
            nb[nn].public_key.data = keys[nn];
            nb[nn].public_key.len = WIRE_KEY_BYTES;
            nb[nn].peer_id = q->key;
            nb[nn].data_endpoint = q->endpoint;
            nb[nn].relay = q->relay || p->relay;
        } else {
            nb[nn].data_endpoint = (char *)"";
        }
        nbp[nn] = &nb[nn];
        nn++;
    }
    int32_t eos[FU_MODELCFG_MAX_EOS];
    for (size_t i = 0; i < j->n_eos && i < FU_MODELCFG_MAX_EOS; i++)
        eos[i] = (int32_t)j->eos[i];
    a.job_id = j->id64;
    a.stage_index = s;
    a.stage_count = j->n_stages;
    a.node_begin = j->stages[s].first;
    a.node_end = j->stages[s].last;
    a.n_neighbours = nn;
    a.neighbours = nbp;
    a.relay = p->relay;
    a.dag.data = j->dag_bytes;
    a.dag.len = j->dag_len;
    a.model_id = j->model->id;
    a.resume_step = j->start_step;
    a.backup = backup;
    a.spec_json = j->spec_canon;
    a.verify = broker_job_verify_fraction(b, j);
    if (j->kind == DB_JOB_INFER) {
        a.n_eos_ids = j->n_eos < FU_MODELCFG_MAX_EOS ? j->n_eos : FU_MODELCFG_MAX_EOS;
        a.eos_ids = eos;
    }
    return broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, j->id64, &a.base);
}

void broker_start_stages(broker_t *b, broker_job *j, uint64_t resume_step, const char *reason)
{
    broker_job_starting(b, j, resume_step, reason);
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (p && p->live)
            (void)broker_send_assign(b, j, s, p, false);
    }
}
