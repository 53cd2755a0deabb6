/* `fusion keygen`: makes a long-term key pair (public.key, secret.key) in a directory, or prints a
 * fresh enrolment token for a broker operator. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "fu_opts.h"
#include "wire_keys.h"
#include "wire_zap.h"

int cli_keygen_main(int argc, char **argv)
{
    const char *dir = NULL;
    bool force = false, token = false;
    const fu_opt opts[] = {
        {"out", 'o', FU_OPT_STR, &dir, "DIR", "directory for public.key and secret.key (created 0700 if missing)"},
        {"force", 0, FU_OPT_FLAG, &force, NULL, "replace keys that already exist in DIR"},
        {"token", 0, FU_OPT_FLAG, &token, NULL, "print a new random enrolment token for a broker instead"},
    };
    const fu_cmd cmd = {
        .prog = argv[0],
        .usage = "-o DIR [--force] | --token",
        .summary = "Makes an X25519 key pair: DIR/public.key (share it) and DIR/secret.key (mode 0600, keep it "
                   "private). Brokers, peers and clients each need one; a peer or client also needs the "
                   "broker's public.key. Existing keys are never overwritten without --force.",
        FU_OPTS_TABLE(opts),
    };
    int exit_code = FU_EXIT_OK;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &exit_code) != FU_OK)
        return exit_code;
    if (token) {
        char t[WIRE_KEY_Z85_LEN + 1];
        wire_token_generate(t);
        printf("%s\n", t);
        return FU_EXIT_OK;
    }
    if (!dir) {
        fprintf(stderr, "%s: say where to write the keys: -o DIR\n", argv[0]);
        return FU_EXIT_USAGE;
    }
    wire_keypair_t *kp = wire_keypair_generate();
    if (!kp) {
        fprintf(stderr, "%s: cannot allocate secure memory for the key\n", argv[0]);
        return FU_EXIT_FAIL;
    }
    fu_errmsg em = {{0}};
    fu_err rc = wire_keypair_save(kp, dir, force, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], fu_errmsg_text(&em, rc));
        wire_keypair_destroy(&kp);
        return FU_EXIT_FAIL;
    }
    printf("public key: %s\nwrote %s/%s and %s/%s (mode 0600)\n", wire_keypair_public_z85(kp), dir,
           WIRE_PUBLIC_KEY_FILE, dir, WIRE_SECRET_KEY_FILE);
    wire_keypair_destroy(&kp);
    return FU_EXIT_OK;
}
