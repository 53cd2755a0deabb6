#!/usr/bin/env bash
# The link emulator keeps its word (issue "Home links"): for each condition, fusion-linkemu between
# two network namespaces, UDP round trips (netprobe rtt) and a bulk TCP transfer (netprobe bulk,
# goodput over its last three quarters) measured from the hosts, within 10% of what was asked:
# the round trip 2·(delay a + delay b), the goodput the narrower link's rate less the TCP/IP headers
# (1448 payload bytes a 1500-byte packet). A stalling link holds a round trip for the stall's length.
#
#   tests/linkemu/run.sh LINKEMU NETPROBE
#
# Exits 77 (skipped) when not root or when TUN devices or namespaces cannot be made here.
set -euo pipefail
EMU=$1
PROBE=$2
[ -x "$EMU" ] && [ -x "$PROBE" ] || { echo "linkemu: $EMU or $PROBE not built" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "linkemu: skipped: needs root"; exit 77; }
[ -c /dev/net/tun ] || { echo "linkemu: skipped: no /dev/net/tun"; exit 77; }
command -v ip >/dev/null || { echo "linkemu: skipped: no ip command"; exit 77; }
TAG=le$$
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fusion-linkemu-XXXXXX")
EMU_PID=
SRV_PID=
stop_emu() {
  for p in $SRV_PID $EMU_PID; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  EMU_PID=
  SRV_PID=
  for h in a b; do ip netns del "$TAG-$h" 2>/dev/null || true; done
}
cleanup() { local rc=$?; stop_emu; rm -rf "$WORK"; exit $rc; }
trap cleanup EXIT
trap 'exit 130' INT TERM

within() { # what got want: |got - want| <= 10% of want
  awk -v g="$2" -v w="$3" -v what="$1" 'BEGIN { d = g - w; if (d < 0) d = -d;
    printf "  %-22s %9.2f (asked %.2f, %+.1f%%)\n", what, g, w, 100 * (g - w) / w; exit !(d <= 0.10 * w) }'
}

# condition NAME A_UP A_DOWN A_DELAY B_UP B_DOWN B_DELAY BULK_MB [STALL]
condition() {
  local name=$1 aup=$2 adown=$3 adelay=$4 bup=$5 bdown=$6 bdelay=$7 mb=$8 stall=${9:-}
  rm -f "$WORK/ready"
  "$EMU" --tag "$TAG" --host "a:10.89.0.1:$aup:$adown:$adelay" --host "b:10.89.0.2:$bup:$bdown:$bdelay" \
    --duration 120 --max-mib 512 --ready "$WORK/ready" --seed 7 ${stall:+--stall "$stall"} 2>"$WORK/emu.log" &
  EMU_PID=$!
  for _ in $(seq 1 100); do [ -f "$WORK/ready" ] && break; sleep 0.05; done
  [ -f "$WORK/ready" ] || { cat "$WORK/emu.log"; echo "linkemu: skipped: the emulator could not set up"; exit 77; }
  ip netns exec "$TAG-b" "$PROBE" serve 9100 >"$WORK/serve.out" &
  SRV_PID=$!
  sleep 0.2
  echo "$name"
  local n=20
  [ -n "$stall" ] && n=40
  local r
  r=$(ip netns exec "$TAG-a" "$PROBE" rtt 10.89.0.2 9100 $n)
  local med max
  med=$(echo "$r" | awk '{print $2}')
  max=$(echo "$r" | awk '{print $4}')
  within "round trip (ms)" "$med" "$(awk -v a="$adelay" -v b="$bdelay" 'BEGIN { print 2 * (a + b) }')"
  if [ -n "$stall" ]; then
    local secs=${stall#*:}
    awk -v m="$max" -v s="$secs" 'BEGIN { printf "  longest round trip %.0f ms (stalls of %.0f ms)\n", m, 1000 * s;
      exit !(m >= 900 * s) }'
  fi
  ip netns exec "$TAG-a" "$PROBE" bulk 10.89.0.2 9100 "$mb"
  wait $SRV_PID
  SRV_PID=
  local g
  g=$(awk '/goodput_mbit/ {print $2}' "$WORK/serve.out")
  local rate
  rate=$(awk -v u="$aup" -v d="$bdown" 'BEGIN { r = u < d ? u : d; print r * 1448 / 1500 }')
  [ -n "$stall" ] || within "goodput a->b (Mbit/s)" "$g" "$rate"
  stop_emu
}

condition "100 Mbit/s, 20 ms round trip" 100 100 5 100 100 5 24
condition "20 Mbit/s, 60 ms round trip" 20 20 15 20 20 15 6
condition "50/10 Mbit/s (a's uplink 10), 40 ms round trip" 10 50 10 10 50 10 4
condition "a link that stalls 0.5 s, 20% of the time" 20 20 5 20 20 5 1 0.2:0.5
echo "linkemu: every condition within 10%"
