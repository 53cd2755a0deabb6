/* `fusion result JOB -o DIR`: downloads a finished job's result (a fine-tune's PEFT adapter:
 * adapter_model.safetensors + adapter_config.json; an inference job's output.txt). Each file is
 * reassembled from chunks, checked against the BLAKE2b-256 hash the broker sends with it, and
 * written atomically: a failed download leaves no partial file behind. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "cli.h"
#include "cli_conn.h"
#include "cli_jobs.h"
#include "fu_alloc.h"
#include "fu_file.h"

#define CLI_RESULT_WINDOW    (16u << 20) /* bytes one JobResultRequest is answered with (docs/PROTOCOL.md) */
#define CLI_RESULT_MAX_FILE  (1ull << 32) /* largest result file accepted */
#define CLI_RESULT_MAX_FILES 8

typedef struct {
    char name[128];   /* a plain file name, checked */
    uint8_t *data;    /* total bytes */
    uint64_t total;
    uint64_t have;    /* bytes received, in order */
    uint8_t hash[32]; /* as announced */
} result_file;

/* A name the broker sends must be a plain file name: no directories, no dot files. */
static bool name_ok(const char *n)
{
    size_t len = n ? strlen(n) : 0;
    return len > 0 && len < 128 && n[0] != '.' && !strchr(n, '/') && strspn(n, "abcdefghijklmnopqrstuvwxyz"
                                                                             "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") == len;
}

static int take_chunk(const char *prog, const Fusion__JobResultChunk *c, result_file *files, size_t *nf)
{
    if (!name_ok(c->file_name) || c->content_hash.len != 32 || c->total > CLI_RESULT_MAX_FILE) {
        fprintf(stderr, "%s: the broker sent a malformed result chunk\n", prog);
        return FU_EXIT_FAIL;
    }
    result_file *f = NULL;
    for (size_t i = 0; i < *nf; i++)
        if (strcmp(files[i].name, c->file_name) == 0)
            f = &files[i];
    if (!f) {
        if (*nf == CLI_RESULT_MAX_FILES) {
            fprintf(stderr, "%s: the result has too many files\n", prog);
            return FU_EXIT_FAIL;
        }
        f = &files[(*nf)++];
        snprintf(f->name, sizeof f->name, "%s", c->file_name);
        f->total = c->total;
        f->data = fu_malloc((size_t)c->total);
        memcpy(f->hash, c->content_hash.data, 32);
    }
    if (c->total != f->total || c->offset != f->have || c->data.len > f->total - f->have ||
        memcmp(f->hash, c->content_hash.data, 32) != 0) {
        fprintf(stderr, "%s: the broker's result chunks for %s do not fit together\n", prog, f->name);
        return FU_EXIT_FAIL;
    }
    if (c->data.len)
        memcpy(f->data + f->have, c->data.data, c->data.len);
    f->have += c->data.len;
    return FU_EXIT_OK;
}

int cli_result_main(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const char *out = NULL;
    bool force = false;
    const fu_opt opts[] = {
        {"output", 'o', FU_OPT_STR, &out, "DIR", "where to write the result (created if missing)"},
        {"force", 0, FU_OPT_FLAG, &force, NULL, "replace files of the same names in DIR"},
        CLI_CONN_OPTS(&co),
    };
    const fu_cmd cmd = {.prog = argv[0], .usage = "JOB -o DIR [options]",
                        .summary = "Downloads a finished job's result: a fine-tune's adapter in PEFT format "
                                   "(adapter_model.safetensors, adapter_config.json), or an inference job's "
                                   "output.txt. A fine-tune that failed or was cancelled gives the adapter of its "
                                   "last checkpoint. Every file is checked against its hash before it is written.",
                        FU_OPTS_TABLE(opts), .min_pos = 1, .max_pos = 1};
    uint64_t id;
    int code;
    if (cli_job_cmd_parse(&cmd, argc, argv, &id, NULL, &code) != FU_OK)
        return code;
    if (!out) {
        fprintf(stderr, "%s: say where to write the result: -o DIR\n", argv[0]);
        return FU_EXIT_USAGE;
    }
    cli_conn_t *conn = NULL;
    if (cli_conn_open(argv[0], &co, &conn, &code) != FU_OK)
        return code;

    result_file files[CLI_RESULT_MAX_FILES];
    memset(files, 0, sizeof files);
    size_t nf = 0;
    uint64_t offset = 0;
    bool last = false;
    code = FU_EXIT_OK;
    while (!last && code == FU_EXIT_OK) {
        Fusion__JobResultRequest req = FUSION__JOB_RESULT_REQUEST__INIT;
        req.job_id = id;
        req.offset = offset;
        wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, .job_id = id};
        uint64_t window_end = offset + CLI_RESULT_WINDOW;
        /* One request, then chunks until the window or the result ends. */
        for (bool first = true; !last && offset < window_end && code == FU_EXIT_OK; first = false) {
            wire_msg_t *m = NULL;
            fu_err rc = first ? cli_conn_call(conn, &h, &req.base, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, &m, &code)
                              : cli_conn_recv(conn, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, &m, &code);
            if (rc != FU_OK)
                break;
            const Fusion__JobResultChunk *c = (const Fusion__JobResultChunk *)wire_msg_body(m);
            code = take_chunk(argv[0], c, files, &nf);
            offset += c->data.len;
            last = c->last;
            wire_msg_destroy(&m);
        }
    }
    /* A fine-tune that failed or was cancelled gives the adapter of its last checkpoint: say so. */
    if (code == FU_EXIT_OK) {
        wire_msg_t *m = NULL;
        int scode;
        if (cli_job_fetch_status(conn, id, &m, &scode) == FU_OK) {
            const Fusion__JobStatus *s = (const Fusion__JobStatus *)wire_msg_body(m);
            if (s->state != FUSION__JOB_STATE__JOB_STATE_DONE)
                fprintf(stderr, "%s: job %s is %s: %s\n", argv[0], argv[1], cli_job_state_name(s->state),
                        s->message ? s->message : "");
            wire_msg_destroy(&m);
        }
    }
    cli_conn_close(&conn);

    fu_errmsg em = {0};
    if (code == FU_EXIT_OK && fu_mkdir_p(out, 0755, &em) != FU_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], fu_errmsg_text(&em, FU_EIO));
        code = FU_EXIT_FAIL;
    }
    for (size_t i = 0; i < nf && code == FU_EXIT_OK; i++) {
        result_file *f = &files[i];
        uint8_t hash[32];
        crypto_generichash(hash, sizeof hash, f->data, (size_t)f->have, NULL, 0);
        if (f->have != f->total || sodium_memcmp(hash, f->hash, sizeof hash) != 0) {
            fprintf(stderr, "%s: %s arrived damaged (hash mismatch); nothing was written — try again\n", argv[0],
                    f->name);
            code = FU_EXIT_FAIL;
        }
    }
    for (size_t i = 0; i < nf && code == FU_EXIT_OK; i++) {
        char *path = fu_path_join(out, files[i].name);
        if (!force && fu_path_exists(path)) {
            fprintf(stderr, "%s: %s exists; use --force to replace it\n", argv[0], path);
            code = FU_EXIT_FAIL;
        } else if (fu_file_write_atomic(path, files[i].data, (size_t)files[i].total, 0644, &em) != FU_OK) {
            fprintf(stderr, "%s: %s\n", argv[0], fu_errmsg_text(&em, FU_EIO));
            code = FU_EXIT_FAIL;
        } else {
            printf("%s (%" PRIu64 " bytes)\n", path, files[i].total);
        }
        free(path);
    }
    for (size_t i = 0; i < nf; i++)
        free(files[i].data);
    return code;
}
