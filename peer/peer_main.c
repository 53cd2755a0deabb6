/* fusion-peer: a volunteer compute peer that runs pipeline stages for the broker. */
#include <stdio.h>

#include <sodium.h>

#include "fu_opts.h"

int main(int argc, char **argv)
{
    const char *broker = NULL, *broker_key = NULL, *keys = NULL, *device = "cpu", *data_bind = NULL;
    const char *cache = NULL, *name = NULL;
    long long threads = 0;
    double max_memory = 0;
    bool no_listen = false;
    const fu_opt opts[] = {
        {"broker", 0, FU_OPT_STR, &broker, "ENDPOINT", "the broker's control endpoint (tcp://HOST:7700)"},
        {"broker-key", 0, FU_OPT_STR, &broker_key, "FILE", "the broker's public key file"},
        {"keys", 0, FU_OPT_STR, &keys, "DIR", "this peer's key directory (from `fusion keygen`)"},
        {"device", 0, FU_OPT_STR, &device, "DEV", "cpu or cuda:N (default cpu)"},
        {"threads", 0, FU_OPT_INT, &threads, "N", "compute threads (default: all cores)"},
        {"data-bind", 0, FU_OPT_STR, &data_bind, "ENDPOINT", "where neighbours connect for activations"},
        {"no-listen", 0, FU_OPT_FLAG, &no_listen, NULL, "accept no connections; relay through the broker"},
        {"cache", 0, FU_OPT_STR, &cache, "DIR", "weight cache directory"},
        {"max-memory", 0, FU_OPT_DOUBLE, &max_memory, "GB", "most memory to offer"},
        {"name", 0, FU_OPT_STR, &name, "NAME", "a name shown by `fusion peers`"},
    };
    const fu_cmd cmd = {
        .prog = "fusion-peer",
        .usage = "--broker ENDPOINT --broker-key FILE --keys DIR [options]",
        .summary = "Joins a fusion broker as a compute peer: measures this machine, runs the pipeline\n"
                   "stages it is given, and leaves cleanly on SIGINT or SIGTERM.",
        .opts = opts,
        .n_opts = sizeof opts / sizeof opts[0],
    };
    size_t npos;
    int code;
    if (fu_opts_parse(&cmd, argc, argv, &npos, &code) != FU_OK)
        return code;
    if (sodium_init() < 0) {
        fprintf(stderr, "fusion-peer: libsodium failed to initialise\n");
        return FU_EXIT_FAIL;
    }
    fprintf(stderr, "fusion-peer: not available yet: the peer daemon comes with the capability "
                    "\"fusion-peer\", which this build does not have\n");
    return FU_EXIT_USAGE;
}
