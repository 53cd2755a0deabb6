/* peer_io_internal: what the files of fusion-peer's I/O thread share (peer.c: lifecycle, loop,
 * heartbeats, the stash; peer_link.c: the sealed data links; peer_session.c: the broker's and the
 * compute thread's messages). Private to those files: the compute thread's side is peer_internal.h. */
#ifndef FU_PEER_IO_INTERNAL_H
#define FU_PEER_IO_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fusion.pb-c.h"
#include "kern_backend.h"
#include "peer.h"
#include "peer_guest.h"
#include "peer_internal.h"
#include "peer_profile.h"
#include "peer_verify.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_seal.h"
#include "wire_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IO_POLL_MS        100   /* longest poll: signals and timers are checked at least this often */
#define IO_MONITOR_EP     "inproc://fusion-peer-monitor" /* + a number per broker socket */
#define IO_CONNECT_WAIT_MS 5000 /* how long the start waits for the broker's handshake */
/* The broker socket's first reconnect after a dropped connection (libzmq adds up to as much again at
 * random, then doubles it up to WIRE_RECONNECT_MAX_MS): the broker declares a peer whose connection
 * closed dead unless it hears from it within 200-250 ms (broker_conn.c), and WIRE_RECONNECT_MS (100,
 * so 100-199 ms) with the handshake and our heartbeat did not always fit in that under load. */
#define IO_BROKER_RECONNECT_MS 20
#define IO_BROKER_RECONNECT_MAX_MS 500 /* the broker socket's longest reconnect interval (an outage) */
#define IO_ENROL_WAIT_MS  10000
#define IO_SWITCH_MIN_MS  250   /* with several broker endpoints: the least time without a connection
                                   before the next endpoint is tried (else half a heartbeat interval) */
#define IO_MAX_TENSOR     ((size_t)1 << 31) /* largest activation/gradient accepted */
#define PEER_PROBE_BYTES  (4u << 20) /* LinkProbe payload asked for after joining */
#define PEER_SEND_WAIT_MS 60000u    /* longest one chunk of a tensor waits for room at a neighbour */
#define PEER_HELD         16        /* data-plane messages held while a send waits */
#define PEER_PROBE_EVERY_MS 600000u  /* a rejoin measures the link again after this long */

enum { LINK_UP_IDX = 0, LINK_DOWN_IDX = 1 };
enum { SRC_ROUTER = 0, SRC_DOWN = 1, SRC_RELAY = 2, SRC_COUNT };

typedef struct {
    bool active;                   /* part of the current assignment */
    bool up;                       /* sealed both ways */
    bool relay;                    /* frames go through the broker */
    uint8_t pk[WIRE_KEY_BYTES];    /* the neighbour's long-term key, as the broker introduced it */
    char pk_z85[WIRE_KEY_Z85_LEN + 1];
    char id_z85[WIRE_KEY_Z85_LEN + 1]; /* the broker's name for it (Neighbour.peer_id): relay_to, sender */
    char endpoint[256];            /* where to connect (downstream, direct) */
    uint32_t stage_index;          /* the neighbour's stage */
    wire_seal_eph_t *eph;          /* our pending ephemeral pair (an opening of ours awaits its reply) */
    bool hello_sent;               /* our opening SealHello with eph went out */
    uint64_t open_seq;             /* Envelope.sequence of that opening (the reply echoes it) */
    wire_seal_t *seal;             /* the session, once up */
    uint8_t rid[WIRE_MAX_ROUTING_ID]; /* upstream over our ROUTER: its routing id */
    size_t rid_len;
    wire_tensor_asm_t *asm_;       /* incoming tensors of this link */
} link_t;

struct peer {
    peer_cfg cfg;                  /* strings borrowed from the caller (main's argv) */
    char *cache_dir;               /* resolved cache directory */
    uint64_t cache_max_bytes;      /* --cache-max-gb in bytes (0: no limit) */
    char name[128];                /* resolved peer name */
    void *ctx;                     /* ZeroMQ context */
    wire_keypair_t *kp;            /* our long-term key pair */
    wire_endpoints eps;            /* the broker's endpoints and keys (--broker, --broker-key) */
    uint32_t ep_cur;               /* the one the broker socket connects to */
    uint64_t lost_ms;              /* no handshaken connection to ep[ep_cur] since (0: connected) */
    const kern_backend_t *be;
    peer_profile prof;
    char prof_line[512];
    void *broker;                  /* DEALER, CURVE client */
    void *router;                  /* data-plane ROUTER, or NULL (--no-listen) */
    void *down;                    /* DEALER to the downstream stage, or NULL */
    void *pipe;                    /* PAIR to the compute thread */
    void *mon;                     /* monitor of the broker socket (its connection's events), or NULL */
    uint32_t mon_n;                /* broker sockets monitored so far (names each monitor's endpoint) */
    uint32_t handshakes;           /* CURVE handshakes with the broker on this socket so far */
    char data_endpoint[256];       /* advertised in PeerHello; "" with --no-listen */
    uint64_t session;              /* random, for this process's PeerHellos (fusion.proto) */
    pthread_t compute;
    bool compute_started;
    peer_shared shared;            /* compute -> io state */
    peer_compute_cfg ccfg;

    bool welcomed;                 /* PeerWelcome seen since the last PeerHello */

    bool known;                    /* welcomed at least once: heartbeats go on while a PeerHello said

                                      again waits for its Welcome (behind bulk data on a slow link, it

                                      may take seconds: a peer that stopped beating was declared dead) */
    uint32_t hb_ms, dead_ms;       /* from PeerWelcome */
    uint32_t hb_n;                 /* heartbeats sent on time: one in PEER_HB_ASK_EVERY asks for an answer */
    uint64_t last_broker_ms;       /* last message from the broker */
    uint64_t last_hb_ms;           /* last Heartbeat sent */
    uint64_t hello_ms;             /* last PeerHello sent */
    uint64_t probe_t0_ns;          /* LinkProbeRequest in flight since (0: none) */
    uint64_t probe_done_ms;        /* last LinkProbe answered or refused (0: never) */
    uint64_t seq;                  /* envelope sequence towards the broker */

    link_t links[2];               /* upstream, downstream */
    uint64_t job_id;               /* the assignment's job (0: none) */
    uint64_t gen;                  /* number of the current assignment (peer_link_open_all) */
    uint64_t open_counter;         /* numbers our SealHello openings */
    uint32_t stage_index;
    bool ready_pending;            /* compute is loaded; StageReady once the links are up */
    uint64_t assign_ms;            /* when the links were asked to open */
    wire_msg_t *early[SRC_COUNT];  /* SealHellos that came before their assignment */
    uint8_t early_rid[WIRE_MAX_ROUTING_ID];
    size_t early_rid_len;

    peer_cmd *stash[PEER_STASH];   /* for the compute thread, when its pipe is full */
    size_t stash_head, stash_n;
    wire_counters counters;        /* data and control messages refused */
    peer_vin_asm_t *vin;           /* verification inputs delivered to this peer (as a verifier) */
    bool leaving;                  /* Leave sent */
    uint64_t leave_ms;
    bool fatal;                    /* the compute thread failed */
    fu_err fatal_err;

    wire_msg_t *held[PEER_HELD];   /* read while a send waited and not a tensor chunk (a SealHello):
                                      handled by the loop next */
    int held_src[PEER_HELD];
    size_t n_held;
    bool send_waited;              /* the last tensor send found a full queue */
    peer_guest_t *guest;           /* priority, duty cycle, pauses */
    unsigned pause_mask;           /* the pause last reported (PEER_PAUSE_*) */
    char pause_text[200];          /* its reason, for heartbeats */
};

/* ---- peer.c -------------------------------------------------------------------------------- */

/* Whether the operator asked the peer to stop (peer_request_stop). */
bool peer_io_stop_requested(void);

/* Sends body to the broker in a fresh envelope; logs a failure. */
fu_err peer_io_to_broker(peer_t *p, Fusion__MsgType type, uint64_t job, uint64_t step, uint32_t stage,
                         const ProtobufCMessage *body);

/* Hands c to the compute thread, or holds it in the stash (takes c). */
void peer_io_deliver(peer_t *p, peer_cmd *c);

/* Passes what the stash holds to the compute thread while its pipe has room. */
void peer_io_flush_stash(peer_t *p);

/* True while the stash is nearly full: input is not read. */
bool peer_io_input_paused(const peer_t *p);

/* Says PeerHello (again): the peer counts as unwelcomed until PeerWelcome. */
void peer_io_send_hello(peer_t *p);

/* A Heartbeat now; on_time: the timer's beat (the schedule moves on). */
void peer_io_send_heartbeat(peer_t *p, bool on_time);

/* ---- peer_session.c ------------------------------------------------------------------------ */

/* A message from the broker (takes m). */
void peer_io_on_broker(peer_t *p, wire_msg_t *m);

/* A command from the compute thread (takes c). */
void peer_io_on_compute(peer_t *p, peer_cmd *c);

/* ---- peer_link.c --------------------------------------------------------------------------- */

/* Frees a link's keys and assembler and zeroes it. */
void peer_link_reset(link_t *l);

/* Closes both links and the downstream socket; the peer has no assignment. */
void peer_link_close_all(peer_t *p);

/* Opens the links of a new (non-backup) assignment; SealHellos that came early are taken now. */
void peer_link_open_all(peer_t *p, const Fusion__StageAssign *a);

/* Largest activation/gradient a neighbour may send. */
size_t peer_link_max_tensor(const peer_t *p);

/* Sends StageReady once the compute thread is loaded and every active link is up. */
void peer_link_check_ready(peer_t *p);
/* Tells the broker that stage `stage` of job is ready (StageReady), and logs "...: <what>". */
void peer_link_send_ready(peer_t *p, uint64_t job, uint32_t stage, const char *what);

/* A data-plane message from src (SRC_*; takes m). */
void peer_link_on_data(peer_t *p, int src, wire_msg_t *m);

/* Reads data-plane messages from sock (NULL: none) while the compute thread keeps up. */
void peer_link_read_data(peer_t *p, void *sock, int src, bool hold);

/* Handles what was held while a send waited. */
void peer_link_handle_held(peer_t *p);

/* Seals and sends the tensor of c over its link (c stays the caller's). */
void peer_link_send_tensor(peer_t *p, peer_cmd *c);

#ifdef __cplusplus
}
#endif

#endif
