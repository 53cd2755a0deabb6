/* dag_serial: a DAG to and from protobuf bytes (proto/dag.proto, message fusion.dag.Graph).
 * Decoding treats the bytes as hostile: the length is capped, unpacking goes through a byte-budgeted
 * allocator, every enum, count, string and dimension is checked, and the result passes
 * dag_graph_validate before it is returned. */
#ifndef FU_DAG_SERIAL_H
#define FU_DAG_SERIAL_H

#include <stddef.h>
#include <stdint.h>

#include "dag_graph.h"
#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_SCHEMA_VERSION   1u
#define DAG_MAX_ENCODED      (16u << 20) /* largest encoded graph accepted */
#define DAG_DECODE_BUDGET    (64u << 20) /* most heap protobuf-c may use unpacking one graph */

/* Encodes g into a new buffer (*buf, caller frees with free()) of *len bytes. FU_EINVAL when g is
 * NULL or fails validation. */
FU_MUST_CHECK fu_err dag_graph_encode(const dag_graph_t *g, uint8_t **buf, size_t *len);

/* Decodes len bytes into a new validated graph (*out, caller destroys). FU_EPROTO with a message in
 * em (may be NULL) for anything malformed, FU_ENOMEM when over DAG_MAX_ENCODED or the unpack budget,
 * FU_EVERSION for another schema version. Never asserts; never leaks; thread-safe. This is the
 * entry point of the libFuzzer target. */
FU_MUST_CHECK fu_err dag_graph_decode(const uint8_t *buf, size_t len, dag_graph_t **out, fu_errmsg *em);

#ifdef __cplusplus
}
#endif
#endif
