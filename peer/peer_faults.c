/* peer_faults: the test-only fault hooks (see peer_faults.h), read from the environment. */
#include "peer_faults.h"

#ifdef FUSION_TEST_HOOKS
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

peer_corrupt_mode peer_fault_corrupt_now(void)
{
    const char *v = getenv(PEER_CORRUPT_ENV);
    peer_corrupt_mode m = PEER_CORRUPT_NONE;
    size_t n = 0;
    if (v && strncmp(v, "scale", 5) == 0) {
        m = PEER_CORRUPT_SEND;
        n = 5;
    } else if (v && strncmp(v, "lie", 3) == 0) {
        m = PEER_CORRUPT_LIE;
        n = 3;
    } else if (v && strncmp(v, "nudge", 5) == 0) {
        m = PEER_CORRUPT_NUDGE;
        n = 5;
    } else if (v && strncmp(v, "ring", 4) == 0) {
        m = PEER_CORRUPT_RING;
        n = 4;
    } else {
        return PEER_CORRUPT_NONE;
    }
    if (v[n] == '\0')
        return m;
    return v[n] == ':' && v[n + 1] && access(v + n + 1, F_OK) == 0 ? m : PEER_CORRUPT_NONE;
}

bool peer_fault_stall_ready(void)
{
    const char *v = getenv(PEER_STALL_ENV);
    return v && strncmp(v, "ready:", 6) == 0 && v[6] && access(v + 6, F_OK) == 0;
}

int64_t peer_fault_stall_step(void)
{
    const char *v = getenv(PEER_STALL_ENV);
    if (!v || strncmp(v, "step:", 5) != 0 || v[5] < '0' || v[5] > '9')
        return -1;
    char *end = NULL;
    unsigned long long n = strtoull(v + 5, &end, 10);
    if (n > INT64_MAX || !end || *end != ':' || !end[1] || access(end + 1, F_OK) != 0)
        return -1;
    return (int64_t)n;
}

bool peer_fault_verify_late(void)
{
    const char *v = getenv(PEER_VERIFY_LATE_ENV);
    return v && strcmp(v, "1") == 0;
}
#endif
