/* fusion-broker: the registry, scheduler, backup pool and job store daemon. */
#include <stdio.h>

#include <sodium.h>

#include "fu_opts.h"

int main(int argc, char **argv)
{
    const char *bind = "tcp://*:7700", *keys = NULL, *db = NULL, *allow = NULL, *token = NULL;
    long long backups = 1, heartbeat_ms = 1000;
    const fu_opt opts[] = {
        {"bind", 0, FU_OPT_STR, &bind, "ENDPOINT", "control-plane endpoint (default tcp://*:7700)"},
        {"keys", 0, FU_OPT_STR, &keys, "DIR", "the broker's key directory (from `fusion keygen`)"},
        {"db", 0, FU_OPT_STR, &db, "FILE", "SQLite job store (created if missing)"},
        {"allow", 0, FU_OPT_STR, &allow, "FILE", "admit only the public keys listed in FILE"},
        {"enrol-token", 0, FU_OPT_STR, &token, "TOKEN", "admit any key that presents TOKEN"},
        {"backups", 0, FU_OPT_INT, &backups, "N", "spare peers to keep warm per job (default 1)"},
        {"heartbeat-ms", 0, FU_OPT_INT, &heartbeat_ms, "MS", "heartbeat interval (default 1000)"},
    };
    const fu_cmd cmd = {
        .prog = "fusion-broker",
        .usage = "--keys DIR --db FILE [options]",
        .summary = "Runs the fusion broker: keeps the registry of peers, schedules jobs onto them as\n"
                   "pipeline stages, keeps a backup pool, and stores jobs durably in SQLite.",
        .opts = opts,
        .n_opts = sizeof opts / sizeof opts[0],
    };
    size_t npos;
    int code;
    if (fu_opts_parse(&cmd, argc, argv, &npos, &code) != FU_OK)
        return code;
    if (sodium_init() < 0) {
        fprintf(stderr, "fusion-broker: libsodium failed to initialise\n");
        return FU_EXIT_FAIL;
    }
    fprintf(stderr, "fusion-broker: not available yet: the broker daemon comes with the capability "
                    "\"fusion-broker\", which this build does not have\n");
    return FU_EXIT_USAGE;
}
