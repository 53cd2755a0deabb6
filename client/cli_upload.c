#include "cli_upload.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "cli.h"
#include "cli_progress.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_file.h"

#define HASH_LEN 32
#define CLI_UPLOAD_WAITS 6000 /* 100 ms apart: how long the broker's commit may take */
#define CLI_UPLOAD_WINDOW 4   /* chunks in flight: a round trip per window, not per chunk */

/* The regular files of dir with plain names, sorted (the manifest's order). */
static fu_err list_files(const char *prog, const char *dir, char ***names, size_t *n, int *exit_code)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "%s: cannot read the model directory '%s': %s\n", prog, dir, strerror(errno));
        *exit_code = FU_EXIT_NOTFOUND;
        return FU_ENOTFOUND;
    }
    char **v = NULL;
    size_t k = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        char *p = fu_path_join(dir, e->d_name);
        struct stat st;
        bool reg = stat(p, &st) == 0 && S_ISREG(st.st_mode);
        free(p);
        if (!reg)
            continue;
        v = fu_realloc(v, (k + 1) * sizeof *v);
        v[k++] = fu_strdup(e->d_name);
    }
    closedir(d);
    for (size_t i = 1; i < k; i++) /* insertion sort: a model has a handful of files */
        for (size_t j = i; j > 0 && strcmp(v[j - 1], v[j]) > 0; j--) {
            char *t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    *names = v;
    *n = k;
    return FU_OK;
}

/* Where chunk c of the manifest lies. */
typedef struct {
    size_t file;
    uint64_t offset;
    uint32_t len;
} chunk_at;

/* The upload's progress line (cli_progress.h): MiB sent of those to send, the rate, the chunks the
 * broker had already. */
static void progress(cli_progress *p, const cli_upload_report *r, uint64_t to_send, uint32_t already, bool done)
{
    double sent = (double)r->bytes_sent / 1048576.0, total = (double)to_send / 1048576.0;
    double el = fu_clock_sec() - p->start_s;
    char count[64], detail[96];
    snprintf(count, sizeof count, "%.1f/%.1f MiB", sent, total);
    snprintf(detail, sizeof detail, "%.1f MiB/s, %u chunks already on the broker", el > 0 ? sent / el : 0.0,
             already);
    cli_progress_draw(p, to_send ? sent : 1, to_send ? total : 1, count, detail, NULL);
    if (done)
        cli_progress_break();
}

fu_err cli_upload_model(cli_conn_t *conn, const char *prog, const char *dir, bool quiet,
                        char name[CLI_UPLOAD_NAME_MAX], cli_upload_report *rep, int *exit_code)
{
    cli_upload_report scratch;
    rep = rep ? rep : &scratch;
    memset(rep, 0, sizeof *rep);
    double t0 = fu_clock_sec();
    char **names = NULL;
    size_t n = 0;
    FU_TRY(list_files(prog, dir, &names, &n, exit_code));
    Fusion__ModelUpload mu = FUSION__MODEL_UPLOAD__INIT;
    Fusion__UploadFile *files = fu_calloc(n + 1, sizeof *files);
    Fusion__UploadFile **fp = fu_calloc(n + 1, sizeof *fp);
    int *fds = fu_calloc(n + 1, sizeof *fds);
    chunk_at *at = NULL;
    uint8_t *buf = fu_malloc(WIRE_UPLOAD_CHUNK); /* wire_send copies it: reused at once */
    fu_err rc = FU_OK;
    uint32_t nc = 0;
    for (size_t i = 0; i < n; i++)
        fds[i] = -1;
    /* the manifest: every file hashed chunk by chunk */
    for (size_t i = 0; i < n && rc == FU_OK; i++) {
        fusion__upload_file__init(&files[i]);
        fp[i] = &files[i];
        char *p = fu_path_join(dir, names[i]);
        fds[i] = open(p, O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (fds[i] < 0 || fstat(fds[i], &st) != 0) {
            fprintf(stderr, "%s: cannot read '%s': %s\n", prog, p, strerror(errno));
            *exit_code = FU_EXIT_FAIL;
            rc = FU_EIO;
        }
        free(p);
        if (rc != FU_OK)
            break;
        files[i].name = names[i];
        files[i].size = (uint64_t)st.st_size;
        files[i].n_chunks = (size_t)((files[i].size + WIRE_UPLOAD_CHUNK - 1) / WIRE_UPLOAD_CHUNK);
        files[i].chunks = fu_calloc(files[i].n_chunks + 1, sizeof *files[i].chunks);
        at = fu_realloc(at, (nc + files[i].n_chunks + 1) * sizeof *at);
        for (size_t k = 0; k < files[i].n_chunks && rc == FU_OK; k++) {
            uint64_t off = (uint64_t)k * WIRE_UPLOAD_CHUNK, left = files[i].size - off;
            uint32_t len = (uint32_t)(left < WIRE_UPLOAD_CHUNK ? left : WIRE_UPLOAD_CHUNK);
            if (pread(fds[i], buf, len, (off_t)off) != (ssize_t)len) {
                cli_progress_break();
                fprintf(stderr, "%s: cannot read '%s/%s' (it changed while read?)\n", prog, dir, names[i]);
                *exit_code = FU_EXIT_FAIL;
                rc = FU_EIO;
                break;
            }
            files[i].chunks[k].data = fu_malloc(HASH_LEN);
            files[i].chunks[k].len = HASH_LEN;
            crypto_generichash(files[i].chunks[k].data, HASH_LEN, buf, len, NULL, 0);
            at[nc++] = (chunk_at){.file = i, .offset = off, .len = len};
            rep->bytes += len;
        }
    }
    rep->chunks = nc;
    mu.n_files = n;
    mu.files = fp;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_MODEL_UPLOAD};
    wire_msg_t *m = NULL;
    uint64_t to_send = 0;
    uint32_t already = 0;
    bool tty = !quiet && isatty(STDERR_FILENO);
    cli_progress bar;
    cli_progress_init(&bar);
    /* announce; send what is asked for; commit; until the broker names the model (it flushes the
     * files on its worker meanwhile: nothing to send, no name yet, ask again) */
    int idle = 0, sends = 0;
    for (int round = 0; rc == FU_OK && idle < CLI_UPLOAD_WAITS && sends < 16; round++) {
        mu.commit = round > 0;
        if ((rc = cli_conn_call(conn, &h, &mu.base, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, &m, exit_code)) != FU_OK)
            break;
        const Fusion__UploadStatus *s = (const Fusion__UploadStatus *)wire_msg_body(m);
        if (s->model && s->model[0]) {
            snprintf(name, CLI_UPLOAD_NAME_MAX, "%s", s->model);
            wire_msg_destroy(&m);
            break;
        }
        if (round == 0) {
            for (size_t i = 0; i < s->n_missing; i++)
                to_send += s->missing[i] < nc ? at[s->missing[i]].len : 0;
            already = nc > s->n_missing ? nc - (uint32_t)s->n_missing : 0;
        }
        size_t nm = s->n_missing, ncp = s->n_copy;
        if (nm + ncp == 0 && round > 0) {
            wire_msg_destroy(&m);
            idle++;
            usleep(100 * 1000);
            continue;
        }
        sends++;
        uint32_t *todo = fu_malloc((nm + ncp + 1) * sizeof *todo);
        bool *stub = fu_malloc((nm + ncp + 1) * sizeof *stub);
        for (size_t i = 0; i < nm; i++)
            todo[i] = s->missing[i], stub[i] = false;
        for (size_t i = 0; i < ncp; i++)
            todo[nm + i] = s->copy[i], stub[nm + i] = true;
        wire_msg_destroy(&m);
        size_t in_flight = 0;
        for (size_t i = 0; i < nm + ncp && rc == FU_OK; i++) {
            uint32_t c = todo[i];
            if (c >= nc) {
                cli_progress_break();
                fprintf(stderr, "%s: the broker asked for chunk %u of %u\n", prog, c, nc);
                *exit_code = FU_EXIT_FAIL;
                rc = FU_EPROTO;
                break;
            }
            Fusion__ModelChunk mc = FUSION__MODEL_CHUNK__INIT;
            mc.index = c;
            if (!stub[i]) {
                if (pread(fds[at[c].file], buf, at[c].len, (off_t)at[c].offset) != (ssize_t)at[c].len) {
                    fprintf(stderr, "%s: cannot read '%s/%s'\n", prog, dir, names[at[c].file]);
                    *exit_code = FU_EXIT_FAIL;
                    rc = FU_EIO;
                    break;
                }
                mc.data.data = buf;
                mc.data.len = at[c].len;
            }
            wire_hdr ch = {.type = FUSION__MSG_TYPE__MSG_MODEL_CHUNK};
            if ((rc = cli_conn_send(conn, &ch, &mc.base, exit_code)) != FU_OK)
                break;
            if (++in_flight == CLI_UPLOAD_WINDOW) { /* one answer before the next chunk goes */
                if ((rc = cli_conn_recv(conn, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, &m, exit_code)) != FU_OK)
                    break;
                wire_msg_destroy(&m);
                in_flight--;
            }
            if (stub[i]) {
                rep->copied++;
            } else {
                rep->sent++;
                rep->bytes_sent += at[c].len;
            }
            if (tty)
                progress(&bar, rep, to_send, already, false);
        }
        for (; rc == FU_OK && in_flight > 0; in_flight--) {
            if ((rc = cli_conn_recv(conn, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, &m, exit_code)) == FU_OK)
                wire_msg_destroy(&m);
        }
        free(todo);
        free(stub);
    }
    if (rc == FU_OK && !name[0]) {
        cli_progress_break();
        fprintf(stderr, "%s: the broker did not name the uploaded model (it kept asking for chunks, or its commit "
                        "took over %d s)\n",
                prog, CLI_UPLOAD_WAITS / 10);
        *exit_code = FU_EXIT_FAIL;
        rc = FU_EPROTO;
    }
    rep->seconds = fu_clock_sec() - t0;
    if (tty && rc == FU_OK)
        progress(&bar, rep, to_send, already, true);
    for (size_t i = 0; i < n; i++) {
        if (fds[i] >= 0)
            close(fds[i]);
        for (size_t k = 0; files[i].chunks && k < files[i].n_chunks; k++)
            free(files[i].chunks[k].data);
        free(files[i].chunks);
        free(names[i]);
    }
    free(names);
    free(files);
    free(fp);
    free(fds);
    free(at);
    free(buf);
    return rc;
}

int cli_upload_main(int argc, char **argv)
{
    cli_conn_opts co = {0};
    bool quiet = false;
    const fu_opt opts[] = {
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print only the model's name"},
        CLI_CONN_OPTS(&co),
    };
    const fu_cmd cmd = {
        .prog = "fusion upload",
        .usage = "[options] DIR",
        .summary = "Sends a Hugging Face model directory to the broker by content and prints the name to submit "
                   "jobs with (`fusion submit --model NAME`). Only the chunks the broker lacks are sent: a second "
                   "upload of the same model, or of one that shares its weights, sends little or nothing.",
        .min_pos = 1,
        .max_pos = 1,
        FU_OPTS_TABLE(opts),
    };
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    cli_conn_t *conn = NULL;
    if (cli_conn_open(cmd.prog, &co, &conn, &code) != FU_OK)
        return code;
    char name[CLI_UPLOAD_NAME_MAX] = "";
    cli_upload_report rep;
    fu_err rc = cli_upload_model(conn, cmd.prog, argv[1], quiet, name, &rep, &code);
    cli_conn_close(&conn);
    if (rc != FU_OK)
        return code;
    printf("%s\n", name);
    if (!quiet)
        fprintf(stderr, "uploaded %s as %s: sent %u of %u chunks (%.1f of %.1f MiB), %u copied by the broker, "
                        "in %.1f s\n", argv[1], name, rep.sent, rep.chunks, (double)rep.bytes_sent / 1048576.0,
                (double)rep.bytes / 1048576.0, rep.copied, rep.seconds);
    return FU_EXIT_OK;
}
