/* fusion-peer with the real fusion-broker and the real client, as processes on loopback (the
 * two-stage test cluster of tests/cluster.h: an 8-layer model over 60 MiB peers, one warm backup):
 *   - a fine-tune through a two-stage pipeline gives the adapter `fusion run finetune` gives in one
 *     process (same data order, same arithmetic);
 *   - SIGKILL of the last stage's peer mid-job: the broker moves the stage to the warm backup, every
 *     stage rewinds to the newest common checkpoint, and the final adapter is still the same;
 *   - the same with SIGTERM (Leave), and with a SIGKILLed broker restarted on the same store;
 *   - inference equals `fusion run infer`, also across a failover mid-generation;
 *   - enrolment with a token;
 *   - the peers' connections to the broker cut mid-job (a TCP proxy between them, killed and
 *     started again): each peer beats at once on its new connection, no peer is declared dead, the
 *     stages stay where they are and the adapter is the uninterrupted run's;
 *   - the peers leave on SIGTERM with exit 0.
 * The adapter is downloaded with `fusion result` once the job is done. */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "cluster.h"
#include "fu_clock.h"
#include "testutil.h"
#include "wire_zap.h"

#define N_PEERS 3
#define COMMON  "--rank 4 --batch 4 --seq-len 16 --lr 0.01" /* the options of every fine-tune here */

/* Starts the cluster: 3 peers, one of them a warm backup. */
static tu_cluster *cluster_start(const char *tag)
{
    tu_opts o = tu_opts_two_stage(N_PEERS, 1);
    tu_cluster *c = tu_cluster_new(tag, &o);
    tu_cluster_start(c);
    return c;
}

/* The broker's log says that job id's stage 1 moved to another peer. */
static void assert_moved(const tu_cluster *c, const char *id)
{
    bool moved = tu_broker_logged(c, "job %s: stage 1 moved from", id);
    if (!moved)
        tu_file_show(tu_broker_log(c), 30);
    assert_true(moved);
}

/* Submits a 100-step fine-tune and waits until stage 1 has committed its checkpoint at step 40. */
static void submit_long(tu_cluster *c, char id[17])
{
    tu_submit_finetune(c, id, "model", COMMON " --steps 100 --checkpoint-every 20");
    if (!tu_broker_wait_log(c, 60000, "job %s: checkpoint of stage 1 at step 40 committed", id)) {
        tu_file_show(tu_broker_log(c), 30);
        fail_msg("no checkpoint at step 40");
    }
}

static void test_peer_broker_pipeline_equals_single_process(void **state)
{
    (void)state;
    tu_cluster *c = cluster_start("peer-broker");
    char id[17];
    tu_submit_finetune(c, id, "model", COMMON " --steps 12 --micro-batches 1 --checkpoint-every 4");
    tu_wait_done(c, id, 80);
    bool two = tu_broker_logged(c, "job %s stage 1/2", id);
    if (!two)
        tu_file_show(tu_broker_log(c), 60);
    assert_true(two); /* the job really ran as a two-stage pipeline */
    tu_assert_same_adapter(c, id, "model", COMMON " --steps 12");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The last stage's peer goes away mid-job: SIGKILL (dead after the heartbeat timeout) or SIGTERM
 * (Leave: it drains and exits 0). Either way the job ends with the uninterrupted run's adapter. */
static void lose_stage(int sig)
{
    tu_cluster *c = cluster_start(sig == SIGKILL ? "peer-failover" : "peer-leave");
    /* Submit without waiting, kill the last stage's peer after a checkpoint, then wait. */
    char id[17];
    submit_long(c, id);
    int victim = tu_stage_peer(c, id, 1, 1000);
    printf("%s p%d (stage 1)\n", sig == SIGKILL ? "SIGKILL to" : "SIGTERM to", victim);
    int vcode = tu_peer_stop(c, victim, sig, 15000);
    if (sig == SIGTERM)
        assert_int_equal(vcode, 0); /* Leave, StageRelease, exit 0 */
    tu_wait_done(c, id, 80);
    assert_moved(c, id);
    tu_assert_same_adapter(c, id, "model", COMMON " --steps 100");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_peer_broker_failover_keeps_the_adapter(void **state)
{
    (void)state;
    lose_stage(SIGKILL);
}

static void test_peer_broker_leave_keeps_the_adapter(void **state)
{
    (void)state;
    lose_stage(SIGTERM);
}

/* The broker is SIGKILLed mid-job and started again on the same endpoint and store: the peers
 * notice its silence, say PeerHello again, the broker resumes the job from the newest common
 * checkpoint, and the adapter is still the uninterrupted run's. */
static void test_peer_broker_restart_keeps_the_adapter(void **state)
{
    (void)state;
    tu_cluster *c = cluster_start("peer-brestart");
    char id[17];
    submit_long(c, id);
    printf("SIGKILL to the broker, then a restart on %s\n", tu_broker_endpoint(c));
    (void)tu_broker_stop(c, SIGKILL);
    tu_broker_start(c); /* the same endpoint and store; its log is broker-2.log */
    tu_wait_done(c, id, 80);
    int rejoined = 0;
    char *bl = tu_broker_log_text(c);
    for (const char *q = bl; (q = strstr(q, "registered: ")) != NULL; q++) /* "re-registered: " */
        rejoined++;
    for (const char *q = bl; (q = strstr(q, ") joined: ")) != NULL; q++)
        rejoined++;
    free(bl);
    printf("%d peers registered again with the restarted broker\n", rejoined);
    assert_true(rejoined >= 2);
    tu_assert_same_adapter(c, id, "model", COMMON " --steps 100");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The generated bytes of an inference job (`fusion result`'s output.txt). */
static char *infer_result(tu_cluster *c, const char *id, size_t *len)
{
    tu_result(c, id);
    char p[TU_PATH];
    tu_path(c, p, "res-%s/output.txt", id);
    char *r = tu_file_text(p);
    *len = strlen(r);
    return r;
}

static char *run_infer(tu_cluster *c, const char *opts, size_t *len)
{
    char *out = NULL;
    int rc = tu_fusion(c, &out, "run infer --model model %s 2>/dev/null", opts);
    if (rc != 0)
        fail_msg("fusion run infer failed: %s", out);
    *len = strlen(out);
    if (*len && out[*len - 1] == '\n')
        out[--(*len)] = '\0';
    return out;
}

/* Job id's generation through the pipeline equals `fusion run infer` with opts. */
static void expect_same_text(tu_cluster *c, const char *id, const char *opts, const char *when)
{
    size_t n1, n2;
    char *got = infer_result(c, id, &n1), *want = run_infer(c, opts, &n2);
    printf("infer %s%s: pipeline %zu bytes, fusion run %zu bytes, %s\n", id, when, n1, n2,
           n1 == n2 && memcmp(got, want, n1) == 0 ? "identical" : "DIFFERENT");
    assert_int_equal(n1, n2);
    assert_memory_equal(got, want, n1);
    free(got);
    free(want);
}

/* Generation through the pipeline gives the tokens `fusion run infer` gives (greedy and seeded
 * sampling); killing the last stage mid-generation: the backup rebuilds its KV cache by replaying
 * the prompt and the tokens so far, and the text is unchanged (greedy). */
static void test_peer_broker_inference_equals_single_process(void **state)
{
    (void)state;
    tu_cluster *c = cluster_start("peer-infer");
    const char *runs[] = {"--prompt 'the quick brown fox' --max-tokens 24",
                          "--prompt 'over the lazy dog' --max-tokens 24 --temperature 0.9 --top-k 40 --seed 5"};
    for (size_t k = 0; k < 2; k++) {
        char id[17];
        tu_submit(c, id, "infer --model model %s", runs[k]);
        tu_wait_done(c, id, 60);
        expect_same_text(c, id, runs[k], "");
    }

    /* Failover mid-generation (greedy): kill the last stage's peer once 100 tokens are out. */
    const char *lng = "--prompt 'the river and the stone' --max-tokens 600";
    char id[17];
    tu_submit(c, id, "infer --model model %s", lng);
    uint64_t end = fu_clock_ms() + 60000;
    long done = 0;
    while (done < 100 && fu_clock_ms() < end) {
        char *out = NULL;
        (void)tu_fusion(c, &out, "status %s", id);
        const char *at = out ? strstr(out, id) : NULL;
        const char *sl = at ? strchr(at, '/') : NULL;
        if (sl) {
            const char *q = sl;
            while (q > at && q[-1] >= '0' && q[-1] <= '9')
                q--;
            done = strtol(q, NULL, 10);
        }
        if (out && strstr(out, "done"))
            fail_msg("the generation ended before the kill: %s", out);
        free(out);
        fu_sleep_ms(10);
    }
    assert_true(done >= 100);
    int victim = tu_stage_peer(c, id, 1, 1000);
    printf("killing p%d (stage 1 of the generation) at token %ld\n", victim, done);
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    tu_wait_done(c, id, 80);
    assert_moved(c, id);
    expect_same_text(c, id, lng, " after failover");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Enrolment: a key not on the allow-list enrols with the broker's token (both read it from a 0600
 * file, --enrol-token-file), reconnects as a member and joins; a wrong token (--enrol-token) is
 * refused and the peer exits 3 with a sentence. */
static void test_peer_broker_enrolment(void **state)
{
    (void)state;
    char token[64];
    wire_token_generate(token);
    tu_opts o = tu_opts_default(2);
    o.peers_unlisted = true; /* they must enrol */
    o.enrol_token = token;
    o.heartbeat_ms = 300;
    o.model_args = NULL;
    tu_cluster *c = tu_cluster_new("peer-enrol", &o);
    tu_broker_start(c);
    char token_file[TU_PATH];
    tu_path(c, token_file, "p0.token");
    tu_file_write_private(token_file, token);
    tu_peer_start(c, 0, "--enrol-token-file", token_file, NULL);
    tu_peer_start(c, 1, "--enrol-token", "0000000000000000000000000000000000000000", NULL);
    bool joined = tu_broker_wait_log(c, 20000, "(p0) joined");
    int bad = tu_peer_stop(c, 1, 0, 20000); /* no signal: it exits by itself */
    char plog1[TU_PATH];
    tu_path(c, plog1, "p1.log");
    char *l1 = tu_file_text(plog1);
    printf("wrong token: exit %d: %s", bad, l1);
    bool said = strstr(l1, "enrolment") != NULL;
    free(l1);
    if (!joined)
        tu_file_show(tu_broker_log(c), 30);
    assert_true(joined);
    assert_int_equal(bad, 3);
    assert_true(said);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}


/* ---- a TCP proxy: this program run as `test_peer_broker --tcp-proxy LISTEN_PORT TARGET_PORT` ---- */

/* A middlebox between the peers and the broker on 127.0.0.1: each connection accepted on LISTEN_PORT
 * (0: any, said on stdout) is joined to a new one to TARGET_PORT, byte for byte. Killed, it closes
 * both sides of every connection at once, as a NAT or a firewall that restarts would. It listens
 * with SO_REUSEPORT: its successor listens beside it before it is killed, so the peers' reconnects
 * find the way open at once and the test measures the peers, not how fast it starts a process. */
#define PROXY_ARG "--tcp-proxy"
#define PROXY_SAID "proxy listening on port "

typedef struct {
    int from, to;      /* read from, write to */
    atomic_int *refs;  /* the two directions of one connection: the last one closes both */
} proxy_pump_arg;

static void *proxy_pump(void *arg)
{
    proxy_pump_arg d = *(proxy_pump_arg *)arg;
    free(arg);
    char buf[1 << 16];
    for (;;) {
        ssize_t n = read(d.from, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        ssize_t off = 0;
        while (off < n) {
            ssize_t w = write(d.to, buf + off, (size_t)(n - off));
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                break;
            off += w;
        }
        if (off < n)
            break;
    }
    shutdown(d.from, SHUT_RDWR); /* wakes the other direction */
    shutdown(d.to, SHUT_RDWR);
    if (atomic_fetch_sub(d.refs, 1) == 1) {
        close(d.from);
        close(d.to);
        free(d.refs);
    }
    return NULL;
}

static int proxy_main(int listen_port, int target_port)
{
    signal(SIGPIPE, SIG_IGN);
    int one = 1, ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)listen_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        setsockopt(ls, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0 ||
        bind(ls, (struct sockaddr *)&a, sizeof a) != 0 || listen(ls, 64) != 0 ||
        getsockname(ls, (struct sockaddr *)&a, &al) != 0) {
        perror("proxy: cannot listen");
        return 1;
    }
    printf(PROXY_SAID "%d\n", ntohs(a.sin_port));
    fflush(stdout);
    struct sockaddr_in t = {.sin_family = AF_INET, .sin_port = htons((uint16_t)target_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    for (;;) {
        int in = accept(ls, NULL, NULL);
        if (in < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            perror("proxy: accept");
            return 1;
        }
        int out = socket(AF_INET, SOCK_STREAM, 0);
        if (out < 0 || connect(out, (struct sockaddr *)&t, sizeof t) != 0) {
            perror("proxy: cannot connect to the target");
            close(in);
            if (out >= 0)
                close(out);
            continue;
        }
        (void)setsockopt(in, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        (void)setsockopt(out, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        atomic_int *refs = malloc(sizeof *refs);
        proxy_pump_arg *up = malloc(sizeof *up), *down = malloc(sizeof *down);
        if (!refs || !up || !down)
            abort();
        atomic_init(refs, 2);
        *up = (proxy_pump_arg){.from = in, .to = out, .refs = refs};
        *down = (proxy_pump_arg){.from = out, .to = in, .refs = refs};
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &at, proxy_pump, up) != 0 || pthread_create(&th, &at, proxy_pump, down) != 0)
            abort();
        pthread_attr_destroy(&at);
    }
}

/* Starts the proxy (log DIR/proxy-N.log) from listen_port (0: any) to target_port, and waits until it
 * listens; *port_out: its port. */
static pid_t proxy_start(const tu_cluster *c, int listen_port, int target_port, int *port_out)
{
    static int starts;
    char self[TU_PATH], log[TU_PATH], lp[16], tp[16];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    assert_true(n > 0);
    self[n] = '\0';
    tu_path(c, log, "proxy-%d.log", ++starts);
    snprintf(lp, sizeof lp, "%d", listen_port);
    snprintf(tp, sizeof tp, "%d", target_port);
    char *argv[] = {self, (char *)PROXY_ARG, lp, tp, NULL};
    pid_t pid = tu_spawn(log, argv, NULL);
    if (!tu_file_wait(log, PROXY_SAID, 10000)) {
        tu_file_show(log, 10);
        fail_msg("the TCP proxy did not start");
    }
    char *text = tu_file_text(log);
    *port_out = atoi(strstr(text, PROXY_SAID) + strlen(PROXY_SAID));
    free(text);
    return pid;
}

/* How many times the broker's logs say needle. */
static int broker_log_count(const tu_cluster *c, const char *needle)
{
    int k = 0;
    char *bl = tu_broker_log_text(c);
    for (const char *q = bl; (q = strstr(q, needle)) != NULL; q++)
        k++;
    free(bl);
    return k;
}

/* Milliseconds of the day of a log line's time stamp ("2026-11-29T15:37:25.175Z ..."), -1 if none. */
static long log_ms(const char *line)
{
    int h, m, s, ms;
    if (strlen(line) < 24 || line[10] != 'T' || sscanf(line + 11, "%2d:%2d:%2d.%3d", &h, &m, &s, &ms) != 4)
        return -1;
    return ((h * 60L + m) * 60L + s) * 1000L + ms;
}

/* The longest time, in the broker's log, from a peer's connection closing to its being heard again
 * (the broker's debug lines), over every close; -1 when a close was never followed by hearing. */
static long longest_reheard_ms(const tu_cluster *c)
{
    char *bl = tu_broker_log_text(c);
    long worst = 0;
    static const char closed[] = "): its connection closed; dead unless";
    for (const char *q = bl; (q = strstr(q, closed)) != NULL; q++) {
        const char *sol = q;
        while (sol > bl && sol[-1] != '\n')
            sol--;
        const char *who = strstr(sol, "peer "); /* "peer KEY8 (pN)" */
        char heard[64];
        if (!who || who > q)
            continue;
        snprintf(heard, sizeof heard, "%.*s) was heard again", (int)(q - who), who);
        const char *h = strstr(q, heard);
        if (!h) {
            worst = -1;
            break;
        }
        while (h > bl && h[-1] != '\n')
            h--;
        long d = log_ms(h) - log_ms(sol);
        if (d > worst)
            worst = d;
    }
    free(bl);
    return worst;
}

/* The peers reach the broker through a TCP proxy, which is replaced mid-job (a new one on the same
 * port, the old one SIGKILLed), twice, under one busy loop per core: every peer's connection closes,
 * libzmq connects it again after IO_BROKER_RECONNECT_MS, and fusion-peer beats at once on the new
 * connection, within the broker's grace for a closed connection (250 ms at heartbeat 1000 ms, when
 * the next timed heartbeat can be up to 1000 ms away). No peer is declared dead, no stage moves, and
 * the adapter is the uninterrupted run's. */
static void test_peer_broker_reconnect_keeps_the_stage(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(N_PEERS, 1);
    o.heartbeat_ms = 1000; /* the broker's default: a grace of 250 ms */
    o.log_level = "debug"; /* the closes' times */
    tu_cluster *c = tu_cluster_new("peer-reconnect", &o);
    tu_broker_start(c);
    const char *bep = tu_broker_endpoint(c);
    int bport = atoi(strrchr(bep, ':') + 1), pport = 0;
    pid_t proxy = proxy_start(c, 0, bport, &pport);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", pport);
    for (int i = 0; i < N_PEERS; i++)
        tu_peer_start(c, i, "--broker", ep, NULL); /* the later --broker wins */
    for (int i = 0; i < N_PEERS; i++) {
        char name[16];
        tu_peer_wait_joined(c, i, 30000);
        snprintf(name, sizeof name, "p%d", i);
        assert_true(tu_peer_profile_checked(c, name, 30000));
    }
    char id[17];
    tu_submit_finetune(c, id, "model", COMMON " --steps 60 --checkpoint-every 20");
    if (!tu_broker_wait_log(c, 60000, "job %s: checkpoint of stage 1 at step 20 committed", id)) {
        tu_file_show(tu_broker_log(c), 30);
        fail_msg("no checkpoint at step 20");
    }
    int s0 = tu_stage_peer(c, id, 0, 1000), s1 = tu_stage_peer(c, id, 1, 1000);
    static const char heard[] = "was heard again on a new connection after its connection closed";
    int cores = tu_load_start(0); /* timed (docs/TESTING.md); no connection of ours to copy */
    for (int cut = 1; cut <= 2; cut++) {
        uint64_t t0 = fu_clock_ms();
        pid_t next = proxy_start(c, pport, bport, &pport);
        kill(proxy, SIGKILL);
        (void)tu_reap(proxy, 5000);
        proxy = next;
        /* every peer, once per cut (the broker saw each connection close: it had heard them all) */
        while (broker_log_count(c, heard) < cut * N_PEERS && fu_clock_ms() - t0 < 5000)
            fu_sleep_ms(20);
        int n = broker_log_count(c, heard);
        printf("cut %d: %d peers heard again on a new connection\n", cut, n - (cut - 1) * N_PEERS);
        if (n < cut * N_PEERS || tu_broker_logged(c, "is dead"))
            tu_cluster_show_logs(c);
        assert_int_equal(n, cut * N_PEERS);
        assert_false(tu_broker_logged(c, "is dead"));
        fu_sleep_ms(1500); /* a few heartbeats on the new connections */
    }
    tu_load_stop();
    /* what decides is that nobody was declared dead (above): the broker judges a grace as of the last
     * turn of its loop that read its socket empty, so a loop slowed by the load may log a peer heard
     * later than it heard it */
    printf("connection closed -> heard again (the broker's log): at most %ld ms (grace 250 ms, heartbeat 1000 ms; "
           "%d busy loops)\n", longest_reheard_ms(c), cores);
    tu_wait_done(c, id, 120);
    bool moved = tu_broker_logged(c, "moved from");
    if (moved || tu_broker_logged(c, "is dead"))
        tu_file_show(tu_broker_log(c), 60);
    assert_false(tu_broker_logged(c, "is dead"));
    assert_false(moved);
    assert_int_equal(tu_stage_peer(c, id, 0, 1000), s0);
    assert_int_equal(tu_stage_peer(c, id, 1, 1000), s1);
    for (int i = 0; i < N_PEERS; i++) {
        char plog[TU_PATH];
        tu_path(c, plog, "p%d.log", i);
        assert_true(tu_file_wait(plog, "connected to the broker again: a heartbeat at once", 0));
        /* quiet heartbeats (one in PEER_HB_ASK_EVERY asks for an answer) never made it think the
         * broker had gone silent */
        assert_false(tu_file_wait(plog, "no word from the broker", 0));
    }
    tu_assert_same_adapter(c, id, "model", COMMON " --steps 60");
    assert_int_equal(tu_cluster_stop(&c), FU_OK); /* the peers' Leave goes through the proxy */
    kill(proxy, SIGKILL);
    (void)tu_reap(proxy, 5000);
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], PROXY_ARG) == 0)
        return proxy_main(atoi(argv[2]), atoi(argv[3]));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_peer_broker_pipeline_equals_single_process, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_failover_keeps_the_adapter, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_leave_keeps_the_adapter, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_restart_keeps_the_adapter, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_inference_equals_single_process, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_enrolment, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_reconnect_keeps_the_stage, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
