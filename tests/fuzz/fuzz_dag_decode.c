/* libFuzzer target: the DAG decoder (dag_graph_decode) and everything behind it (size cap, budgeted
 * unpack, field checks, dag_graph_validate). Invariants checked:
 *   - a refusal returns no graph;
 *   - a graph that decodes is valid, re-encodes, and the re-encoding decodes to the same nodes.
 * Built as a libFuzzer binary with -DFUSION_FUZZ=ON (clang), and run over its seed corpus
 * (tests/fuzz/corpus/dag_decode/) as an ordinary test by fuzz_driver.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dag_graph.h"
#include "dag_serial.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    dag_graph_t *g = NULL;
    fu_errmsg em = {{0}};
    fu_err rc = dag_graph_decode(data, size, &g, &em);
    if (rc != FU_OK) {
        if (g || em.msg[0] == '\0')
            __builtin_trap(); /* a refusal says why and returns nothing */
        return 0;
    }
    if (dag_graph_validate(g, NULL) != FU_OK)
        __builtin_trap();
    uint8_t *buf = NULL;
    size_t len = 0;
    if (dag_graph_encode(g, &buf, &len) != FU_OK)
        __builtin_trap();
    dag_graph_t *h = NULL;
    if (dag_graph_decode(buf, len, &h, NULL) != FU_OK || dag_graph_size(h) != dag_graph_size(g))
        __builtin_trap();
    for (size_t i = 0; i < dag_graph_size(g); i++) {
        const dag_node *a = dag_graph_node(g, i), *b = dag_graph_node(h, i);
        if (a->op != b->op || a->n_inputs != b->n_inputs || a->out_width != b->out_width ||
            memcmp(a->inputs, b->inputs, sizeof a->inputs) != 0 || strcmp(a->params[0], b->params[0]) != 0)
            __builtin_trap();
    }
    free(buf);
    dag_graph_destroy(&h);
    dag_graph_destroy(&g);
    return 0;
}
