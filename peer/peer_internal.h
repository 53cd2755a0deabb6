/* peer_internal: what the I/O thread and the compute thread (peer_stage.c) share besides the pipe's
 * messages (peer_pipe.h, included here): the state the compute thread publishes for the heartbeat, and
 * the configuration it starts with. */
#ifndef FU_PEER_INTERNAL_H
#define FU_PEER_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include "kern_backend.h"
#include "peer_guest.h"
#include "peer_pipe.h"

/* States the compute thread publishes for the heartbeat (Fusion__PeerState values). */
typedef struct {
    _Atomic int state;        /* PEER_STATE_IDLE / WARM / BUSY */
    _Atomic int stage_active; /* 1 while an assignment (not a backup) is held */
    _Atomic int exited;       /* the compute thread has left its loop */
    /* Fine-tuning progress of the stage held, for the heartbeat (the broker's step deadline finds
     * the stage that stalled from it), in one word: the step worked on plus 1 (0: none) << 32 |
     * micro-batches through forward << 16 | through backward. */
    _Atomic uint64_t progress;
    /* Bytes a second from the broker, once measured (the link probe) or stated (--link-mbps); 0: not
     * known. Fetches size their windows by it (peer_blob_set_window). */
    _Atomic uint64_t link_bytes_per_s;
} peer_shared;

typedef struct {
    void *ctx;                   /* the ZeroMQ context (sockets are made in the compute thread) */
    const kern_backend_t *be;    /* backend */
    const char *cache_dir;       /* weight cache */
    uint64_t cache_max_bytes;    /* weight cache size limit (0: none) */
    uint64_t mem_budget;         /* most bytes one blob may take */
    peer_shared *shared;         /* published state */
    const uint8_t *self_pk;      /* this peer's long-term public key (32 bytes) */
    peer_guest_t *guest;         /* pauses and duty cycle (the executor's yield hook); borrowed */
    kern_priority priority;      /* the compute thread sets itself to it */
} peer_compute_cfg;

/* The compute thread's body: connects the PAIR's other end and serves commands until STOP. */
void *peer_compute_main(void *arg /* peer_compute_cfg * */);

#endif
