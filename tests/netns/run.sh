#!/usr/bin/env bash
# Multi-host end-to-end test: a broker, three peers and a client, each in its own network namespace
# with its own address on one bridged network (10.77.0.0/24, private to the namespaces made here),
# so that every control and data connection crosses a real veth link instead of loopback.
#
#   tests/netns/run.sh [ADAPTER_DIFF]     (as root; ctest runs it as test_e2e_netns_multihost)
#
# A fine-tune job is submitted from the client's namespace; its adapter (fetched with `fusion
# result`) must equal `fusion run finetune` on the same model (max abs difference <= 1e-5, checked by
# ADAPTER_DIFF, the test_e2e_pipeline executable's --adapter-diff mode). Programs come from
# $FUSION_BIN_DIR (default build/bin), the data from $FUSION_SOURCE_DIR/deploy/data/shakespeare.txt.
# Exits 77 (skipped) when not root or when network namespaces cannot be made here.
# Every exit path removes the namespaces and stops the processes (trap); children also get
# PR_SET_PDEATHSIG (setpriv --pdeathsig) so a killed script leaves none behind, and namespaces left
# by a killed earlier run (named after its pid) are removed at the start.
set -euo pipefail

BIN=${FUSION_BIN_DIR:-build/bin}
SRC=${FUSION_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
DIFF=${1:-$(dirname "$BIN")/tests/test_e2e_pipeline}
DATA=$SRC/deploy/data/shakespeare.txt
NET=10.77.0
TAG=fue$$                 # namespace and interface prefix (interface names stay under 15 bytes)
HOSTS="b p0 p1 p2 c"      # broker, three peers, client
declare -A ADDR=([b]=$NET.1 [p0]=$NET.11 [p1]=$NET.12 [p2]=$NET.13 [c]=$NET.100)
MODEL_ARGS="--layers 6 --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 256 --seed 3"
TRAIN="--rank 4 --alpha 8 --batch 4 --seq-len 16 --lr 0.01 --seed 7 --steps 30"

skip() { echo "netns: skipped: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces)"
command -v ip >/dev/null || skip "no ip command (iproute2)"
for p in fusion fusion-broker fusion-peer; do [ -x "$BIN/$p" ] || { echo "netns: $BIN/$p not built" >&2; exit 1; }; done
[ -x "$DIFF" ] || { echo "netns: $DIFF (test_e2e_pipeline) not built" >&2; exit 1; }
PDEATH=()
setpriv --pdeathsig KILL true 2>/dev/null && PDEATH=(setpriv --pdeathsig KILL)

# Namespaces of earlier runs whose script is gone.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^fue[0-9]+-' || true); do
  pid=${ns#fue}; pid=${pid%%-*}
  kill -0 "$pid" 2>/dev/null || ip netns del "$ns" 2>/dev/null || true
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fusion-netns-XXXXXX")
PIDS=()
cleanup() {
  local rc=$?
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    local left=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ $left = 0 ] && break
    sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  for h in $HOSTS sw; do ip netns del "$TAG-$h" 2>/dev/null || true; done
  if [ $rc = 0 ]; then rm -rf "$WORK"; else
    echo "netns: failed (exit $rc); logs in $WORK"
    for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "---- $f"; tail -n 15 "$f"; }; done
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The network: a bridge in a switch namespace, one veth per host.
ip netns add "$TAG-sw" 2>/dev/null || skip "cannot create network namespaces here"
ip -n "$TAG-sw" link add br0 type bridge || skip "no bridge support"
ip -n "$TAG-sw" link set br0 up
ip -n "$TAG-sw" link set lo up
for h in $HOSTS; do
  ns=$TAG-$h
  ip netns add "$ns"
  ip link add "$TAG$h" type veth peer name "${TAG}s$h"
  ip link set "$TAG$h" netns "$ns"
  ip link set "${TAG}s$h" netns "$TAG-sw"
  ip -n "$TAG-sw" link set "${TAG}s$h" master br0 up
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$TAG$h" name eth0
  ip -n "$ns" addr add "${ADDR[$h]}/24" dev eth0
  ip -n "$ns" link set eth0 up
done
cd "$WORK"
for k in broker client p0 p1 p2; do "$BIN/fusion" keygen -o "$k" >/dev/null; done
for k in client p0 p1 p2; do grep -v '^#' "$k/public.key"; done >allow
"$BIN/fusion" model init -o model $MODEL_ARGS >/dev/null

run_in() { # host log command...
  local h=$1 log=$2; shift 2
  "${PDEATH[@]}" ip netns exec "$TAG-$h" "$@" >"$log" 2>&1 &
  PIDS+=($!)
}
run_in b broker.log "$BIN/fusion-broker" --bind "tcp://${ADDR[b]}:7700" --keys broker --db store.db --allow allow \
  --model-root "$WORK" --backups 0 --heartbeat-ms 500
for _ in $(seq 1 100); do grep -q "listening on" broker.log 2>/dev/null && break; sleep 0.1; done
grep -q "listening on" broker.log || { echo "netns: the broker did not start" >&2; exit 1; }
for i in 0 1 2; do
  run_in "p$i" "p$i.log" "$BIN/fusion-peer" --broker "tcp://${ADDR[b]}:7700" --broker-key broker/public.key \
    --keys "p$i" --name "p$i" --data-bind "tcp://${ADDR[p$i]}:7701" --cache "cache$i" --threads 1 \
    --max-memory 0.039 --drain-timeout 15 --priority normal # a test cluster, not a guest (docs/TESTING.md)
done
for i in 0 1 2; do
  for _ in $(seq 1 300); do grep -q "(p$i) joined" broker.log && break; sleep 0.1; done
  grep -q "(p$i) joined" broker.log || { echo "netns: peer p$i did not join" >&2; exit 1; }
done
grep "joined" broker.log | sed 's/^.*\] //'

cat >client.conf <<CONF
broker = tcp://${ADDR[b]}:7700
broker-key = $WORK/broker/public.key
keys = $WORK/client
CONF
client() { FUSION_CONFIG=$WORK/client.conf ip netns exec "$TAG-c" "$BIN/fusion" "$@"; }
t0=$(date +%s.%N)
JOB=$(client submit finetune --model model --data "$DATA" $TRAIN --checkpoint-every 10 -q)
echo "netns: job $JOB submitted from ${ADDR[c]} to the broker at ${ADDR[b]}"
client wait "$JOB" -q --wait-timeout 70 >/dev/null
t1=$(date +%s.%N)
grep "job $JOB stage" broker.log | sed 's/^.*\] //' | cut -c1-110
grep -q "job $JOB stage 2/3 on" broker.log || { echo "netns: the job did not run as three stages" >&2; exit 1; }
# Each peer's data endpoint is its own namespace's address: the links crossed the bridge.
for i in 0 1 2; do grep -q "endpoint tcp://${ADDR[p$i]}:7701" broker.log || { echo "netns: p$i not on ${ADDR[p$i]}" >&2; exit 1; }; done
client result "$JOB" -o result >/dev/null
"$BIN/fusion" run finetune --model model --data "$DATA" $TRAIN --threads 1 -o reference >/dev/null
"$DIFF" --adapter-diff result/adapter_model.safetensors reference/adapter_model.safetensors
printf 'netns: job over 3 namespaces (broker %s, peers %s %s %s, client %s) done in %.2f s; adapter equals fusion run\n' \
  "${ADDR[b]}" "${ADDR[p0]}" "${ADDR[p1]}" "${ADDR[p2]}" "${ADDR[c]}" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')"
