/* fusion-gateway: carries many peers' connections to the broker on one (gateway.h). Runs in the
 * foreground and logs to stderr; SIGTERM or SIGINT stop it. */
#include <signal.h>
#include <stdio.h>

#include "fu_log.h"
#include "fu_opts.h"
#include "gateway.h"
#include "wire_keys.h"

static void on_signal(int sig)
{
    (void)sig;
    gateway_request_stop();
}

int main(int argc, char **argv)
{
    const char *listen = GATEWAY_LISTEN_DEFAULT, *broker = NULL, *broker_key = NULL, *keys = NULL, *config = NULL;
    const fu_opt opts[] = {
        {"config", 0, FU_OPT_STR, &config, "FILE", "read options from FILE (`name = value` lines)"},
        {"listen", 0, FU_OPT_STR, &listen, "ENDPOINT", "where peers connect (default " GATEWAY_LISTEN_DEFAULT ")"},
        {"broker", 0, FU_OPT_STR, &broker, "ENDPOINT", "the broker's gateway endpoint (fusion-broker --gateway-bind)"},
        {"broker-key", 0, FU_OPT_STR, &broker_key, "FILE", "the broker's public key file"},
        {"keys", 0, FU_OPT_STR, &keys, "DIR",
         "the gateway's key directory (from `fusion keygen`): peers use its public key as the broker's, and the "
         "broker's allow-list must give it the gateway role"},
    };
    const fu_cmd cmd = {
        .prog = "fusion-gateway",
        .usage = "--broker ENDPOINT --broker-key FILE --keys DIR [--listen ENDPOINT]",
        .summary = "Carries many peers' connections to a fusion broker on one connection, so that one broker\n"
                   "serves tens of thousands of peers (docs/SCALE.md \"Gateways\"). Peers connect to it as to\n"
                   "the broker, with its public key. Runs in the foreground; SIGTERM or SIGINT stop it.",
        FU_OPTS_TABLE(opts),
    };
    int code;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!broker || !broker_key || !keys)
        return fu_opts_usage_error(&cmd, "--broker, --broker-key and --keys are required");
    static const int stop_signals[] = {SIGTERM, SIGINT};
    code = fu_opts_daemon_start(cmd.prog, on_signal, stop_signals, sizeof stop_signals / sizeof *stop_signals);
    if (code != FU_EXIT_OK)
        return code;
    fu_errmsg em = {{0}};
    uint8_t broker_pk[WIRE_KEY_BYTES];
    wire_keypair_t *kp = NULL;
    fu_err err = wire_key_load_public(broker_key, broker_pk, &em);
    if (err == FU_OK)
        err = wire_keypair_load(keys, &kp, &em);
    if (err != FU_OK) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_errmsg_text(&em, err));
        return err == FU_ENOTFOUND ? FU_EXIT_NOTFOUND : FU_EXIT_FAIL;
    }
    gateway_cfg cfg = {.listen = listen, .broker = broker, .broker_pk = broker_pk, .kp = kp};
    gateway_t *g = gateway_new(&cfg, &err, &em);
    if (!g) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_errmsg_text(&em, err));
        wire_keypair_destroy(&kp);
        return FU_EXIT_FAIL;
    }
    fu_err rc = gateway_run(g);
    gateway_destroy(&g);
    wire_keypair_destroy(&kp);
    FU_INFO("gateway", "stopped");
    return rc == FU_OK ? FU_EXIT_OK : FU_EXIT_FAIL;
}
