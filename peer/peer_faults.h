/* peer_faults: fault-injection hooks FOR TESTS ONLY (the verification and deadline tests make a peer
 * cheat or stall through them). They are compiled in only when FUSION_TEST_HOOKS is defined (CMake
 * option FUSION_TEST_HOOKS, on in every build type but Release): a release binary has no hooks and
 * ignores the variables below. */
#ifndef FU_PEER_FAULTS_H
#define FU_PEER_FAULTS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Env var of the fault-injection hook, FOR TESTS ONLY: "scale" multiplies the output this peer
 * produces as a stage (not as a verifier) by PEER_CORRUPT_SCALE: the activations it sends down, or,
 * at the last stage, the gradients it sends up; the peer keeps (and sketches, and delivers to
 * verifiers) what it sent. "lie" sends the scaled output too but keeps the honest one: its own
 * sketches agree, and what it delivers to the next stage's verifier differs from what the next
 * stage received. "nudge" sends and keeps its output with the first value moved by one unit in the
 * last place: far inside any tolerance, caught only where verification compares exact bits.
 * "ring", at the last stage of an inference job, sends stage 0 over the ring another token than the
 * one it reports to the broker (the next id); stage 0 must notice and the broker stop trusting it.
 * "MODE:PATH" does so only while the file PATH exists. A peer run this way is a dishonest peer;
 * verification must catch it. */
#define PEER_CORRUPT_ENV   "FUSION_TEST_CORRUPT_OUTPUT"
#define PEER_CORRUPT_SCALE 1.5f

typedef enum {
    PEER_CORRUPT_NONE = 0, /* honest */
    PEER_CORRUPT_SEND,     /* "scale": sends and keeps the scaled output */
    PEER_CORRUPT_LIE,      /* "lie": sends the scaled output, keeps the honest one */
    PEER_CORRUPT_NUDGE,    /* "nudge": sends and keeps the output with its first value one ulp off */
    PEER_CORRUPT_RING,     /* "ring": tells stage 0 another token than the broker */
} peer_corrupt_mode;

/* Env var of the stall hook, FOR TESTS ONLY (the deadline tests of tests/test_e2e_fault.c): the
 * peer stays alive and keeps heartbeating but stops doing a stage's work, as a hung weight fetch or
 * a stuck step would. "ready:PATH": while the file PATH exists, a stage assignment (not a backup's)
 * never says StageReady. "step:N:PATH": the first time this process, as a stage of a fine-tune, is
 * to work on step N while PATH exists, it drops that step's work (frames, forwards) until its next
 * StageAssign; it stalls once per process. Anything else: no stall. */
#define PEER_STALL_ENV "FUSION_TEST_STALL"

/* Env var of the late-verification hook, FOR TESTS ONLY (tests/test_verify.c): "1": as a stage's own
 * peer (not a backup) this peer reads each VerifyRequest only once its stage has moved
 * WIRE_VERIFY_KEEP_STEPS steps past the request's step (or finished its steps), as an honest peer on a
 * loaded machine may; by then it no longer holds what was asked for and answers `unavailable`. The
 * broker must not blame it (docs/PIPELINE.md "Verification"). Anything else: no delay. */
#define PEER_VERIFY_LATE_ENV "FUSION_TEST_VERIFY_LATE"

#ifdef FUSION_TEST_HOOKS
/* What the fault-injection hook asks this peer to do with its outputs now. */
peer_corrupt_mode peer_fault_corrupt_now(void);
/* True when the stall hook withholds StageReady now. */
bool peer_fault_stall_ready(void);
/* The step at which the stall hook stalls a fine-tune stage now, or -1 for none. */
int64_t peer_fault_stall_step(void);
/* True when the late-verification hook holds a stage's VerifyRequests back. */
bool peer_fault_verify_late(void);
#else
static inline peer_corrupt_mode peer_fault_corrupt_now(void)
{
    return PEER_CORRUPT_NONE;
}
static inline bool peer_fault_stall_ready(void)
{
    return false;
}
static inline int64_t peer_fault_stall_step(void)
{
    return -1;
}
static inline bool peer_fault_verify_late(void)
{
    return false;
}
#endif

#ifdef __cplusplus
}
#endif
#endif
