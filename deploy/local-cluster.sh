#!/usr/bin/env bash
# A broker and N peers on this machine, over loopback, for trying fusion out and for tests.
#
#   deploy/local-cluster.sh up [N]   start a broker and N peers (default 3); prints how to use it
#   deploy/local-cluster.sh down     stop everything it started (SIGTERM, then SIGKILL after 10 s)
#   deploy/local-cluster.sh status   what is running, and the broker's view of its peers
#
# Everything lives under $CLUSTER_DIR (default ./var/cluster): keys, the allow-list, the broker's
# SQLite store, logs, pid files, and client.conf, which `fusion` reads through FUSION_CONFIG so no
# broker address or key needs typing. Programs come from $FUSION_BIN (default build/release/bin).
# The broker listens on 127.0.0.1:$FUSION_PORT (default 7700) and serves the models under
# $MODEL_ROOT (default: the directory it is started from; ':'-separated for several).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER_DIR=${CLUSTER_DIR:-var/cluster}
FUSION_BIN=${FUSION_BIN:-build/release/bin}
FUSION_PORT=${FUSION_PORT:-7700}
PEER_THREADS=${PEER_THREADS:-1}
PEER_PRIORITY=${PEER_PRIORITY:-idle} # the peers' compute: idle (a guest, the default), low or normal

die() { echo "local-cluster: $*" >&2; exit 1; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_bg() { # name pidfile logfile command...
  local name=$1 pidf=$2 log=$3; shift 3
  "$@" >"$log" 2>&1 &
  echo $! >"$pidf"
  echo "started $name (pid $!, log $log)"
}

up() {
  local n=${1:-3}
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N must be a positive number, got '$n'"
  for p in fusion fusion-broker fusion-peer; do
    [ -x "$FUSION_BIN/$p" ] || die "$FUSION_BIN/$p not found: build first (cmake --build build/release) or set FUSION_BIN"
  done
  alive "$CLUSTER_DIR/broker.pid" && die "a cluster is already running in $CLUSTER_DIR (deploy/local-cluster.sh down first)"
  mkdir -p "$CLUSTER_DIR/keys" "$CLUSTER_DIR/logs"
  local dir; dir=$(cd "$CLUSTER_DIR" && pwd)

  # Keys are made once and kept, so the store's peers and jobs stay valid across restarts.
  for k in broker client $(seq -f 'peer%g' 1 "$n"); do
    [ -f "$dir/keys/$k/secret.key" ] || "$FUSION_BIN/fusion" keygen -o "$dir/keys/$k" >/dev/null
  done
  : >"$dir/allow.txt"
  for k in client $(seq -f 'peer%g' 1 "$n"); do
    { cat "$dir/keys/$k/public.key"; echo; } >>"$dir/allow.txt"
  done
  cat >"$dir/client.conf" <<CONF
# fusion client configuration for the local cluster (read through FUSION_CONFIG)
broker = tcp://127.0.0.1:$FUSION_PORT
broker-key = $dir/keys/broker/public.key
keys = $dir/keys/client
CONF

  start_bg broker "$dir/broker.pid" "$dir/logs/broker.log" \
    "$FUSION_BIN/fusion-broker" --bind "tcp://127.0.0.1:$FUSION_PORT" --keys "$dir/keys/broker" \
    --db "$dir/broker.db" --allow "$dir/allow.txt" --backups "${BACKUPS:-0}" \
    --model-root "${MODEL_ROOT:-$PWD}"
  sleep 0.3
  alive "$dir/broker.pid" || { cat "$dir/logs/broker.log" >&2; die "the broker did not start (log above)"; }
  for i in $(seq 1 "$n"); do
    start_bg "peer$i" "$dir/peer$i.pid" "$dir/logs/peer$i.log" \
      "$FUSION_BIN/fusion-peer" --broker "tcp://127.0.0.1:$FUSION_PORT" --broker-key "$dir/keys/broker/public.key" \
      --keys "$dir/keys/peer$i" --name "peer$i" --data-bind "tcp://127.0.0.1:*" --cache "$dir/cache/peer$i" \
      --threads "$PEER_THREADS" --priority "$PEER_PRIORITY"
  done

  # Wait until every peer has registered.
  export FUSION_CONFIG="$dir/client.conf"
  local seen=0
  for _ in $(seq 1 100); do
    seen=$("$FUSION_BIN/fusion" peers --json 2>/dev/null | grep -o '"state":"idle"' | wc -l || true)
    [ "$seen" -ge "$n" ] && break
    sleep 0.1
  done
  [ "$seen" -ge "$n" ] || die "only $seen of $n peers registered within 10 s (logs in $dir/logs)"
  echo "cluster up: broker on tcp://127.0.0.1:$FUSION_PORT, $n peers"
  echo "use it with:  export FUSION_CONFIG=$dir/client.conf; $FUSION_BIN/fusion peers"
}

down() {
  local pids=() f
  for f in "$CLUSTER_DIR"/peer*.pid "$CLUSTER_DIR"/broker.pid; do
    [ -f "$f" ] || continue
    if alive "$f"; then pids+=("$(cat "$f")"); kill -TERM "$(cat "$f")" 2>/dev/null || true; fi
    rm -f "$f"
  done
  [ ${#pids[@]} -gt 0 ] || { echo "local-cluster: nothing running"; return 0; }
  for _ in $(seq 1 100); do
    local left=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ $left -eq 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  echo "cluster down (${#pids[@]} processes stopped)"
}

status() {
  local f any=0
  for f in "$CLUSTER_DIR"/broker.pid "$CLUSTER_DIR"/peer*.pid; do
    [ -f "$f" ] || continue
    any=1
    if alive "$f"; then echo "$(basename "$f" .pid): running (pid $(cat "$f"))"; else echo "$(basename "$f" .pid): not running"; fi
  done
  [ $any -eq 1 ] || { echo "local-cluster: no cluster in $CLUSTER_DIR"; return 0; }
  if alive "$CLUSTER_DIR/broker.pid"; then
    FUSION_CONFIG="$CLUSTER_DIR/client.conf" "$FUSION_BIN/fusion" peers || true
  fi
}

case "${1:-}" in
  up) up "${2:-3}" ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up [N] | down | status" >&2; exit 2 ;;
esac
