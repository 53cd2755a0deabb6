/* The short swarm run (bench/swarm/swarm.h, docs/SCALE.md) as a test: 1,000 simulated peers, each
 * with its own CURVE identity and socket, join the real fusion-broker; 4 clients submit 8 fine-tunes
 * while the peers churn (a mean session of 2 minutes: about 8 departures a second, half of them
 * crashes, several of them holding a stage); then the churn stops and the jobs may finish. No job may
 * be lost: every one acknowledged ends done, none fails, none is forgotten. Then the same with the
 * peers behind two fusion-gateways. Each run takes about 45 s (the bench's own bound: 20 s of load,
 * at most 30 s of drain). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "testutil.h"

#define SWARM_TEST_PEERS 1000
#define SWARM_TEST_JOBS  8

/* The "result" line of bench-swarm's output, parsed (caller deletes), NULL when there is none. */
static cJSON *result_line(const char *out)
{
    for (const char *p = out; p && *p;) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        if (n > 0 && strstr(p, "\"case\":\"result\"") && strstr(p, "\"case\":\"result\"") < p + n) {
            char *line = strndup(p, n);
            cJSON *o = cJSON_Parse(line);
            free(line);
            return o;
        }
        p = nl ? nl + 1 : NULL;
    }
    return NULL;
}

static double num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

/* Runs the short swarm with `gateways` fusion-gateways (0: every peer connects to the broker) and
 * checks that no job was lost. */
static void swarm_loses_no_job(int gateways)
{
    char *out = NULL;
    int rc = tu_sh(&out,
                   "%s --peers %d --clients 4 --jobs %d --steps 10 --ckpt-every 5 --duration 20 --drain 30 "
                   "--session 120 --offline 20 --sample 0 --check --quiet --gateways %d",
                   tu_bin("bench-swarm"), SWARM_TEST_PEERS, SWARM_TEST_JOBS, gateways);
    printf("%s", out ? out : "");
    cJSON *r = result_line(out);
    free(out);
    assert_non_null(r);
    assert_int_equal(rc, 0); /* --check: every job done, none lost */
    assert_int_equal((int)num(r, "peers_joined"), SWARM_TEST_PEERS);
    assert_int_equal((int)num(r, "jobs_acked"), SWARM_TEST_JOBS);
    assert_int_equal((int)num(r, "jobs_done"), SWARM_TEST_JOBS);
    assert_int_equal((int)num(r, "jobs_lost"), 0);
    assert_int_equal((int)num(r, "jobs_failed"), 0);
    assert_true(num(r, "departures") > 0);       /* the churn happened */
    assert_true(num(r, "heartbeats_per_s") > 0); /* and the broker answered the beats */
    assert_int_equal((int)num(r, "gateways"), gateways);
    if (gateways)
        assert_true(num(r, "gw_rss_mib") > 0); /* they ran, and carried every peer */
    cJSON_Delete(r);
}

static void test_swarm_churn_loses_no_job(void **state)
{
    (void)state;
    swarm_loses_no_job(0);
}

/* The same with the peers behind two fusion-gateways (docs/SCALE.md "Gateways"): crashes are told by
 * the gateways, every answer finds its peer through one. */
static void test_swarm_churn_through_gateways_loses_no_job(void **state)
{
    (void)state;
    swarm_loses_no_job(2);
}

/* argv[1], when given, names the one test to run (ctest runs each as its own entry, each under a
 * minute). */
int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_swarm_churn_loses_no_job),
                                       cmocka_unit_test(test_swarm_churn_through_gateways_loses_no_job)};
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
