/* `fusion http-token`: the bearer token of this client's key for the broker's HTTP API
 * (fusion-broker --http, GET /api/...; wire_http_token). Made here from the client's secret key and
 * the broker's public key: nothing is sent. */
#include <stdio.h>

#include "cli.h"
#include "cli_conn.h"
#include "fu_opts.h"
#include "wire_keys.h"

int cli_http_token_main(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const fu_opt opts[] = {CLI_CONN_OPTS(&co)};
    const fu_cmd cmd = {.prog = argv[0], .usage = "[options]",
                        .summary = "Prints the bearer token that shows the broker's HTTP API (fusion-broker --http) "
                                   "who you are: `curl -H \"Authorization: Bearer $(fusion http-token)\" "
                                   "http://HOST:PORT/api/jobs` lists your jobs. It is made from your secret key "
                                   "and the broker's public key, and stays the same: keep it as you would a "
                                   "password (it reads your jobs, nothing more).",
                        FU_OPTS_TABLE(opts), .min_pos = 0, .max_pos = 0};
    int code;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (cli_conn_resolve(argv[0], &co, false, &code) != FU_OK)
        return code;
    fu_errmsg em = {{0}};
    uint8_t broker_pk[WIRE_KEY_BYTES];
    wire_keypair_t *kp = NULL;
    fu_err rc = wire_key_load_public(co.broker_key, broker_pk, &em);
    if (rc == FU_OK)
        rc = wire_keypair_load(co.keys, &kp, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], fu_errmsg_text(&em, rc));
        return FU_EXIT_USAGE;
    }
    char token[WIRE_HTTP_TOKEN_LEN + 1];
    rc = wire_http_token(wire_keypair_secret(kp), broker_pk, broker_pk, wire_keypair_public(kp), token);
    wire_keypair_destroy(&kp);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: the broker's public key cannot be used for a token\n", argv[0]);
        return FU_EXIT_FAIL;
    }
    printf("%s\n", token);
    return FU_EXIT_OK;
}
