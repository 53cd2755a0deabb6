/* peer: the fusion-peer daemon as a library (docs/PEER.md; the contract is docs/PIPELINE.md).
 *
 * Two threads (the actor pattern of CONVENTIONS.md):
 *   - the I/O thread (the caller of peer_run) owns every socket: the CURVE DEALER to the broker,
 *     the data-plane ROUTER on --data-bind, the DEALER to the downstream stage, and one end of an
 *     inproc PAIR. It says PeerHello, heartbeats on a timer, opens the sealed links (SealHello),
 *     assembles and opens incoming TensorFrames, seals and sends outgoing ones, and relays through
 *     the broker when a link cannot be direct. It never runs a kernel.
 *   - the compute thread owns the stage: blob fetches, the dag_exec executor, forward/backward per
 *     micro-batch, AdamW, checkpoints and inference sessions. It talks to the I/O thread only over
 *     the PAIR, passing ownership of messages and tensors.
 * Backpressure: the PAIR's high-water mark plus a fixed stash of PEER_STASH messages bound what the
 * I/O thread holds for the compute thread; while the stash is full the I/O thread stops reading the
 * data sockets (TCP and the sender's high-water mark push back to the neighbour) but keeps its
 * heartbeats going.
 *
 * Threads: peer_new, peer_run and peer_destroy from one thread; peer_request_stop from anywhere
 * (async-signal-safe). */
#ifndef FU_PEER_H
#define FU_PEER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "peer_guest.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PEER_SOFTWARE        "fusion 0.1.0"
#define PEER_HEARTBEAT_MS    1000   /* until PeerWelcome says otherwise */
#define PEER_DEAD_AFTER_MS   3000   /* broker silence after which PeerHello is sent again (at least; below) */
#define PEER_HB_ASK_EVERY    5      /* one heartbeat in this many asks for an answer (Heartbeat.quiet off);
                                       PeerHello is said again after (this + 2) heartbeats without a word */
#define PEER_DRAIN_MS        30000  /* most time a leaving peer waits for StageRelease */
#define PEER_STASH           64     /* messages the I/O thread holds for a busy compute thread */
#define PEER_PAIR_HWM        16     /* messages queued on the inproc pipe each way */
#define PEER_CKPT_CHUNK      (1u << 20) /* bytes of one CheckpointPut */
#define PEER_MAX_ASSIGN_WAIT_MS 60000 /* links not up this long after an assignment: an Error */

typedef struct {
    /* The broker's control endpoint, "tcp://HOST:7700", or several, comma-separated (at most
     * WIRE_MAX_ENDPOINTS): the broker's own and its gateways'. The peer uses one at a time, the first
     * first, and moves to the next when it has had no connection to the one it uses for half a
     * heartbeat interval (a gateway that died), or no word through it for the silence that makes it
     * say PeerHello again. Its session, stage and work go with it (docs/PEER.md "Several
     * endpoints"). */
    const char *broker;
    const char *broker_key_file; /* the public key file of that endpoint, or comma-separated, one per
                                    endpoint (a single file: every endpoint answers with that key) */
    const char *keys_dir;        /* this peer's key directory */
    const char *device;          /* "cpu" (default), "cuda", "cuda:N" */
    int threads;                 /* CPU compute threads (0: the backend's default) */
    const char *data_bind;       /* data-plane ROUTER endpoint (for example tcp://0.0.0.0:7701); NULL with no_listen */
    const char *data_advertise;  /* endpoint told to the broker; NULL: derived from data_bind */
    bool no_listen;              /* no ROUTER: every data frame goes through the broker */
    const char *cache_dir;       /* weight cache (NULL: $XDG_CACHE_HOME/fusion or ~/.cache/fusion) */
    double max_memory_gb;        /* cap on the memory offered (0: no cap) */
    double cache_max_gb;         /* blob cache size limit in GiB, least recently used evicted (0: no limit) */
    double link_mbps;            /* the link's speed as stated by the operator, MB/s (0: measure it) */
    double gflops;               /* the GEMM speed stated by the operator, GFLOP/s (0: the measured one); the
                                    broker's profile challenge still caps what plans use */
    const char *name;            /* shown by `fusion peers` (NULL: the host name) */
    const char *enrol_token;     /* enrol with this token first (NULL: already allowed) */
    uint32_t drain_ms;           /* PEER_DRAIN_MS when 0 */
    peer_guest_cfg guest;        /* priority, duty cycle, pauses (peer_guest.h) */
    /* One of several slots of a peer process (fusion-peer --slots; each slot is a child process
     * running its own peer_t): the broker plans each slot as a peer of its own, named by (key, slot).
     * A slot offers 1/n_slots of max_memory_gb (or of the free memory) and of a stated gflops;
     * threads, data_bind and name are the slot's own already. n_slots 0 means 1. */
    uint32_t slot, n_slots;
} peer_cfg;

typedef struct peer peer_t;

/* Loads the keys, picks the backend, measures the profile (GEMM, memory), makes the sockets and
 * starts the compute thread. NULL on failure with *err (may be NULL) and a sentence for the operator
 * in em (may be NULL). */
peer_t *peer_new(const peer_cfg *cfg, fu_err *err, fu_errmsg *em);

/* Runs the I/O loop until a stop: FU_OK after a graceful leave (peer_request_stop, then StageRelease
 * or the drain timeout), FU_ECUDA / FU_EIO after a fatal backend or socket failure (an Error and a
 * Leave were sent first). */
FU_MUST_CHECK fu_err peer_run(peer_t *p);

/* Asks the loop to leave gracefully. Async-signal-safe. */
void peer_request_stop(void);

/* The owner pauses (true) or resumes (false) compute by hand (SIGUSR1 / SIGUSR2). Async-signal-safe. */
void peer_request_pause(bool on);

/* Stops the compute thread, closes the sockets; idempotent; sets *p_p = NULL. */
void peer_destroy(peer_t **p_p);

/* The profile line measured by peer_new (for logs and tests); borrowed. */
const char *peer_profile_line(const peer_t *p);

#ifdef __cplusplus
}
#endif
#endif
