/* fu_net: the IPv4 listen addresses our HTTP listeners take on the command line (fusion-broker
 * --http, fusion serve --listen). Pure; thread-safe. */
#ifndef FU_NET_H
#define FU_NET_H

#include <netinet/in.h>
#include <stdbool.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Parses "IPV4:PORT" (port 0: any free one) into *sa. FU_EINVAL with em naming opt (the option's
 * name, "--http") and the value otherwise. */
FU_MUST_CHECK fu_err fu_net_parse_ipv4(const char *addr, const char *opt, struct sockaddr_in *sa, fu_errmsg *em);

/* Whether sa is a loopback address (127.0.0.0/8): reachable from this machine only. */
bool fu_net_is_loopback(const struct sockaddr_in *sa);

#ifdef __cplusplus
}
#endif
#endif
