#include "fu_net.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fu_err fu_net_parse_ipv4(const char *addr, const char *opt, struct sockaddr_in *sa, fu_errmsg *em)
{
    char host[64];
    const char *colon = addr ? strrchr(addr, ':') : NULL;
    char *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    size_t hl = colon ? (size_t)(colon - addr) : 0;
    if (!colon || hl == 0 || hl >= sizeof host || !end || *end || end == colon + 1 || port < 0 || port > 65535)
        return fu_errmsg_set(em, FU_EINVAL, "%s wants IPV4:PORT (127.0.0.1:9090), not '%.80s'", opt,
                             addr ? addr : "");
    memcpy(host, addr, hl);
    host[hl] = '\0';
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1)
        return fu_errmsg_set(em, FU_EINVAL, "%s: '%s' is not an IPv4 address", opt, host);
    sa->sin_port = htons((uint16_t)port);
    return FU_OK;
}

bool fu_net_is_loopback(const struct sockaddr_in *sa)
{
    return (ntohl(sa->sin_addr.s_addr) >> 24) == 127;
}
