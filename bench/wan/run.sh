#!/usr/bin/env bash
# bench/wan: the pipeline over home internet links (issue "Home links"). For each link condition a
# broker, three peers and a client each live in their own network namespace behind fusion-linkemu
# (tests/linkemu/linkemu.c: every host's access link has the condition's bandwidth and one-way delay),
# and a three-stage fine-tune per wire codec and a three-stage generation run over them. One JSON line
# per condition and codec ("kind":"finetune"):
#   codec                     activations and gradients on the wire (--wire-codec)
#   finetune_tokens_per_s     trained tokens over the job's run (StageStart to done, from the broker log)
#   finetune_vs_lan           that against the LAN condition's with f32 on the wire
#   network_wait_share        the share of the step's time the links add: 1 - (LAN time with the same
#                             codec) / (this time)
#   adapter_same_as_run       the adapter has the bits of `fusion run finetune --cuts` (the plan's cuts)
#                             with the same codec, in one process
#   adapter_same_as_lan       f32: the adapter has the LAN run's bits
#   loss                      the fine-tune's last loss; on LAN (not --quick) also loss_200, the last loss
#                             of a 200-step run, loss_200_vs_f32, its relative change against f32's,
#                             plans_200 (1 unless it was planned again) and adapter_200_same_as_run
# and one per condition for the generation ("kind":"infer"):
#   infer_tokens_per_s        generated tokens over the generation's run
#   infer_stages, ring        the generation's stages (its peers are started again with WAN_GEN_PEER_GB,
#                             default 0.038, so that it takes three) and whether stage 0 took its tokens
#                             straight from the last stage (the ring) rather than through the broker
#   infer_floor_tokens_per_s  one token per round of the generation's hops (stage 0 -> .. -> last stage
#                             -> stage 0, and through the broker without the ring; each one way across
#                             two access links): 1 / (sum of the hops' latencies), what no schedule can
#                             beat; 0 for one stage (no hop)
#   text_same_as_run          the generated text is `fusion run infer`'s
#
#   bench/wan/run.sh BUILD_DIR [--quick] [--only NAME] [--codecs LIST] [--kill]
#
# LIST: --wire-codec values separated by spaces, default "f32 bf16 int8,f32 int8 int8,int8" (int8 alone:
# int8 activations, int8 gradients with error feedback). --kill: a fourth peer is the job's backup, and halfway through each
# f32 fine-tune away from LAN the peer of stage 1 is killed (SIGKILL): the line says when
# ("killed_at_step") and whether the job still ended with the LAN adapter's bits.
#
# WAN_BATCH, WAN_SEQ, WAN_MICRO (default 4, 16, 2) size a step (WAN_MICRO=0: the broker chooses the
# micro-batch count for the links; "micro_batches" says what it chose); WAN_PEER_GB (default 0.039) is
# each peer's memory, which makes the plan three stages (raise it with the step). WAN_MODEL_ARGS
# (`fusion model init` options, default a 6-layer, hidden-256 model) sizes the model: a wider one does
# more compute per byte its cuts send.
#
# BUILD_DIR holds bin/fusion, bin/fusion-broker, bin/fusion-peer and tests/fusion-linkemu (a Release
# build for figures). Needs root (namespaces, TUN); exits 77 otherwise. Bounded: every run has a
# timeout, the emulator a duration and a traffic cap, and every namespace is removed on exit.
set -euo pipefail
BUILD=$(cd "${1:?usage: bench/wan/run.sh BUILD_DIR [--quick] [--only NAME]}" && pwd)
shift
QUICK=0
KILL=0
ONLY=
CODECS="f32 bf16 int8,f32 int8 int8,int8"
while [ $# -gt 0 ]; do
  case $1 in
    --quick) QUICK=1 ;;
    --only) ONLY=$2; shift ;;
    --codecs) CODECS=$2; shift ;;
    --kill) KILL=1 ;;
    *) echo "bench-wan: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
BIN=$BUILD/bin
EMU=$BUILD/tests/fusion-linkemu
SRC=$(cd "$(dirname "$0")/../.." && pwd)
DATA=$SRC/deploy/data/shakespeare.txt
for p in "$BIN/fusion" "$BIN/fusion-broker" "$BIN/fusion-peer" "$EMU"; do
  [ -x "$p" ] || { echo "bench-wan: $p not built" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "bench-wan: skipped: needs root (network namespaces, TUN)"; exit 77; }
[ -c /dev/net/tun ] || { echo "bench-wan: skipped: no /dev/net/tun"; exit 77; }

MODEL_ARGS=${WAN_MODEL_ARGS:-"--layers 6 --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 256 --seed 3"}
STEPS=20
[ $QUICK = 1 ] && STEPS=8
BATCH=${WAN_BATCH:-4} SEQ=${WAN_SEQ:-16} MICRO=${WAN_MICRO:-2} PEER_GB=${WAN_PEER_GB:-0.039} # the step's size, each peer's memory
GEN_PEER_GB=${WAN_GEN_PEER_GB:-0.038} # each peer's memory for the generation (three stages)
TRAIN="--rank 4 --alpha 8 --batch $BATCH --seq-len $SEQ --micro-batches $MICRO --lr 0.01 --seed 7 --steps $STEPS"
GEN=32
TAG=wan$$
NET=10.90.0
declare -A ADDR=([b]=$NET.1 [p0]=$NET.11 [p1]=$NET.12 [p2]=$NET.13 [p3]=$NET.14 [c]=$NET.100)
PEERS="0 1 2"
[ $KILL = 1 ] && PEERS="0 1 2 3" # the fourth is the job's backup
HOSTS="b c"
for i in $PEERS; do HOSTS="$HOSTS p$i"; done
declare -A PEER_PID=()
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fusion-wan-XXXXXX")
PIDS=()
EMU_PID=
PDEATH=()
setpriv --pdeathsig KILL true 2>/dev/null && PDEATH=(setpriv --pdeathsig KILL)

stop_all() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  PIDS=()
  if [ -n "$EMU_PID" ]; then kill -TERM "$EMU_PID" 2>/dev/null || true; wait "$EMU_PID" 2>/dev/null || true; fi
  EMU_PID=
  for h in $HOSTS; do ip netns del "$TAG-$h" 2>/dev/null || true; done
}
cleanup() {
  local rc=$?
  stop_all
  if [ $rc = 0 ] && [ -z "${WAN_KEEP:-}" ]; then rm -rf "$WORK"; else echo "bench-wan: exit $rc; logs in $WORK" >&2; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cd "$WORK"
for k in broker client p0 p1 p2 p3; do "$BIN/fusion" keygen -o "$k" >/dev/null; done
for k in client p0 p1 p2 p3; do grep -v '^#' "$k/public.key"; done >allow
"$BIN/fusion" model init -o model $MODEL_ARGS >/dev/null

run_in() { # host log command...
  local h=$1 log=$2; shift 2
  "${PDEATH[@]}" ip netns exec "$TAG-$h" "$@" >"$log" 2>&1 &
  PIDS+=($!)
}
client() { FUSION_CONFIG=$WORK/client.conf ip netns exec "$TAG-c" "$BIN/fusion" "$@"; }
log_ms() { # the log line's time (ms) of the first line matching the pattern after the other
  grep -F "$1" "$2" | head -n 1 | awk '{ split($1, t, /[T:Z.]/); printf "%d\n", ((t[2] * 60 + t[3]) * 60 + t[4]) * 1000 + t[5] }'
}

joins() { grep -cE "\(p$1\) (joined|re-registered)" "broker-$2.log" || true; } # peer pI's registrations
# start_peers NAME UP_MBIT MEMORY_GB SUFFIX: the peers of condition NAME (logs pI-NAME[SUFFIX].log), joined
start_peers() {
  local name=$1 up=$2 mem=$3 sfx=$4 i
  local -A before=()
  for i in $PEERS; do before[$i]=$(joins "$i" "$name"); done
  for i in $PEERS; do
    run_in "p$i" "p$i-$name$sfx.log" "$BIN/fusion-peer" --broker "tcp://${ADDR[b]}:7700" --broker-key broker/public.key \
      --keys "p$i" --name "p$i" --data-bind "tcp://${ADDR[p$i]}:7701" --cache "cache-$name$i" --threads 1 \
      --max-memory "$mem" --gflops 20 --link-mbps "$up" --drain-timeout 5 --priority normal
    PEER_PID[$i]=${PIDS[-1]}
  done
  for i in $PEERS; do
    for _ in $(seq 1 600); do
      [ "$(joins "$i" "$name")" -gt "${before[$i]}" ] && break
      sleep 0.1
    done
    [ "$(joins "$i" "$name")" -gt "${before[$i]}" ] ||
      { echo "bench-wan: $name: peer p$i did not join" >&2; exit 1; }
  done
}
# stop_peers: SIGTERM to the peers (they leave the broker), waited for
stop_peers() {
  local i p
  for i in "${!PEER_PID[@]}"; do kill -TERM "${PEER_PID[$i]}" 2>/dev/null || true; done
  for i in "${!PEER_PID[@]}"; do
    p=${PEER_PID[$i]}
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
}

# condition NAME UP_MBIT DOWN_MBIT DELAY_MS [STALL]: every host's access link so
condition() {
  local name=$1 up=$2 down=$3 delay=$4 stall=${5:-}
  [ -n "$ONLY" ] && [ "$ONLY" != "$name" ] && [ "$name" != lan ] && return 0
  local hosts=()
  for h in $HOSTS; do hosts+=(--host "$h:${ADDR[$h]}:$up:$down:$delay"); done
  rm -f ready
  "$EMU" --tag "$TAG" "${hosts[@]}" --duration 900 --max-mib 4096 --queue-kib 512 --seed 11 --ready ready \
    ${stall:+--stall "$stall"} 2>"emu-$name.log" &
  EMU_PID=$!
  for _ in $(seq 1 100); do [ -f ready ] && break; sleep 0.05; done
  [ -f ready ] || { cat "emu-$name.log" >&2; echo "bench-wan: the emulator could not start" >&2; exit 1; }
  rm -rf "store-$name.db"* "cache-$name"*
  run_in b "broker-$name.log" "$BIN/fusion-broker" --bind "tcp://${ADDR[b]}:7700" --keys broker \
    --db "store-$name.db" --allow allow --model-root "$WORK" --backups $KILL --heartbeat-ms 1000 --verify 0 \
    --challenge-ms 0 --step-timeout 600
  for _ in $(seq 1 100); do grep -q "listening on" "broker-$name.log" 2>/dev/null && break; sleep 0.1; done
  start_peers "$name" "$up" "$PEER_GB" ""
  cat >client.conf <<CONF
broker = tcp://${ADDR[b]}:7700
broker-key = $WORK/broker/public.key
keys = $WORK/client
CONF
  local stages cuts codec
  for codec in $CODECS; do
    local job t0 t1 loss
    local every=1000 killed=null
    [ $KILL = 1 ] && every=2
    job=$(client submit finetune --model model --data "$DATA" $TRAIN --wire-codec "$codec" --checkpoint-every $every -q)
    if [ $KILL = 1 ] && [ "$codec" = f32 ] && [ "$name" != lan ]; then # kill stage 1's peer halfway
      local at=0 victim
      for _ in $(seq 1 3000); do
        at=$(client status "$job" --json | sed -n 's/.*"step":\([0-9]*\).*/\1/p')
        [ "${at:-0}" -ge $((STEPS / 2)) ] && break
        sleep 0.1
      done
      victim=$(grep "job $job stage 1/" "broker-$name.log" | tail -n 1 | sed -n 's/.* (p\([0-9]\)).*/\1/p')
      [ -n "$victim" ] || { echo "bench-wan: $name: no peer holds stage 1 of $job" >&2; exit 1; }
      kill -KILL "${PEER_PID[$victim]}"
      killed=$at
    fi
    timeout 900 env FUSION_CONFIG="$WORK/client.conf" ip netns exec "$TAG-c" "$BIN/fusion" wait "$job" -q \
      --wait-timeout 880 >/dev/null
    client result "$job" -o "result-$name-$codec" >/dev/null
    stages=$(grep -c "job $job stage [0-9]/" "broker-$name.log" || true)
    cuts=$(grep "job $job stage [1-9]/" "broker-$name.log" | sed -n 's/.*: nodes \([0-9]*\)-.*/\1/p' | paste -sd, -)
    t0=$(log_ms "job $job: every stage is ready; started" "broker-$name.log")
    t1=$(log_ms "job $job done" "broker-$name.log")
    loss=$(client status "$job" --json | sed -n 's/.*"loss":\([0-9.eE+-]*\).*/\1/p')
    local micro
    micro=$(client status "$job" --json | sed -n 's/.*"micro_batches":\([0-9]*\).*/\1/p')
    local same_run=false same_lan=null ref="ref-$stages-$cuts-$codec-$micro-$every"
    [ -d "$ref" ] || "$BIN/fusion" run finetune --model model --data "$DATA" \
      ${TRAIN/--micro-batches $MICRO/--micro-batches ${micro:-$MICRO}} --wire-codec "$codec" --checkpoint-every $every \
      ${cuts:+--cuts "$cuts"} --threads 1 -o "$ref" >/dev/null 2>&1 || [ -z "$cuts" ]
    cmp -s "result-$name-$codec/adapter_model.safetensors" "$ref/adapter_model.safetensors" && same_run=true
    if [ "$codec" = f32 ]; then
      [ "$name" = lan ] && cp "result-$name-$codec/adapter_model.safetensors" lan.adapter
      same_lan=false
      cmp -s "result-$name-$codec/adapter_model.safetensors" lan.adapter && same_lan=true
    fi
    local l200=null plans200=0 same200=null
    if [ "$name" = lan ] && [ $QUICK = 0 ]; then # the codec's effect on the loss: 200 steps on LAN
      local long
      long=$(client submit finetune --model model --data "$DATA" ${TRAIN/--steps $STEPS/--steps 200} \
        --wire-codec "$codec" --checkpoint-every 1000 -q)
      timeout 900 env FUSION_CONFIG="$WORK/client.conf" ip netns exec "$TAG-c" "$BIN/fusion" wait "$long" -q \
        --wait-timeout 880 >/dev/null
      l200=$(client status "$long" --json | sed -n 's/.*"loss":\([0-9.eE+-]*\).*/\1/p')
      [ "$codec" = f32 ] && echo "$l200" >lan.l200
      # the long run's adapter against one process with its plan's cuts and micro-batches
      local lcuts lmicro
      plans200=$(grep -c "job $long stage 0/" "broker-$name.log" || true)
      lcuts=$(grep "job $long stage [1-9]/" "broker-$name.log" | tail -n $((stages - 1)) |
        sed -n 's/.*: nodes \([0-9]*\)-.*/\1/p' | paste -sd, -)
      lmicro=$(client status "$long" --json | sed -n 's/.*"micro_batches":\([0-9]*\).*/\1/p')
      client result "$long" -o "result-200-$codec" >/dev/null
      same200=false
      "$BIN/fusion" run finetune --model model --data "$DATA" \
        $(echo "${TRAIN/--steps $STEPS/--steps 200}" | sed "s/--micro-batches [0-9]*/--micro-batches ${lmicro:-$MICRO}/") \
        --wire-codec "$codec" --checkpoint-every 1000 ${lcuts:+--cuts "$lcuts"} --threads 1 -o "ref-200-$codec" \
        >/dev/null 2>&1 || true
      cmp -s "result-200-$codec/adapter_model.safetensors" "ref-200-$codec/adapter_model.safetensors" && same200=true
    fi
    awk -v n="$name" -v c="$codec" -v up="$up" -v down="$down" -v d="$delay" -v st="${stall:-}" -v s="$stages" \
        -v t0="$t0" -v t1="$t1" -v toks=$((STEPS * BATCH * SEQ)) -v loss="$loss" -v sr=$same_run -v sl=$same_lan \
        -v l200="$l200" -v f200="$(cat lan.l200 2>/dev/null || echo 0)" -v killed="$killed" -v micro="${micro:-0}" \
        -v plans200="$plans200" -v same200="$same200" \
        -v lan="$(cat lan.tps 2>/dev/null || echo 0)" -v lanc="$(cat "lan-$codec.ms" 2>/dev/null || echo 0)" 'BEGIN {
      ms = t1 - t0; tps = toks / (ms / 1000);
      printf "{\"bench\":\"wan\",\"kind\":\"finetune\",\"case\":\"%s\",\"codec\":\"%s\",\"up_mbit\":%g,\"down_mbit\":%g,", n, c, up, down;
      printf "\"rtt_ms\":%g,\"stall\":\"%s\",\"stages\":%d,\"micro_batches\":%d,\"finetune_tokens_per_s\":%.1f,", 4 * d, st, s, micro, tps;
      printf "\"finetune_vs_lan\":%.2f,\"network_wait_share\":%.2f,", (lan > 0 ? tps / lan : 1), (lanc > 0 ? 1 - lanc / ms : 0);
      printf "\"loss\":%s,\"adapter_same_as_run\":%s,\"adapter_same_as_lan\":%s", loss, sr, sl;
      if (l200 != "null") printf ",\"loss_200\":%s,\"loss_200_vs_f32\":%.4f,\"plans_200\":%d,\"adapter_200_same_as_run\":%s",
        l200, (f200 > 0 ? l200 / f200 - 1 : 0), plans200, same200;
      if (killed != "null") printf ",\"killed_at_step\":%s", killed;
      printf "}\n";
      if (n == "lan") { printf "%d\n", ms > ("lan-" c ".ms"); if (c == "f32") printf "%.3f\n", tps > "lan.tps" } }'
  done
  # The generation on peers with less memory, so that it runs as several stages and its tokens cross
  # the links: the ring (stage 0 -> .. -> last stage -> stage 0, one way across two access links each)
  stop_peers
  start_peers "$name" "$up" "$GEN_PEER_GB" "-gen"
  local gen g0 g1 ngen istages ring=false same_text=false
  gen=$(client submit infer --model model --prompt "To be, or not to be" --max-tokens $GEN -q)
  timeout 600 env FUSION_CONFIG="$WORK/client.conf" ip netns exec "$TAG-c" "$BIN/fusion" wait "$gen" -q --wait-timeout 580 \
    >/dev/null
  istages=$(grep -c "job $gen stage [0-9]/" "broker-$name.log" || true)
  ngen=$(client status "$gen" --json | sed -n 's/.*"step":\([0-9]*\).*/\1/p')
  g0=$(log_ms "job $gen: every stage is ready; started" "broker-$name.log")
  g1=$(log_ms "job $gen done" "broker-$name.log")
  grep -qs "job $gen stage 0: tokens come straight from the last stage" p*-"$name"-gen.log && ring=true
  client result "$gen" -o "result-$name-gen" >/dev/null
  [ -f run-gen.txt ] || "$BIN/fusion" run infer -q --threads 1 --model model --prompt "To be, or not to be" \
    --max-tokens $GEN >run-gen.txt 2>/dev/null
  [ "$(cat "result-$name-gen/output.txt")" = "$(cat run-gen.txt)" ] && same_text=true
  awk -v n="$name" -v up="$up" -v down="$down" -v d="$delay" -v st="${stall:-}" -v g0="$g0" -v g1="$g1" -v gen="$ngen" \
      -v is="$istages" -v ring="$ring" -v same="$same_text" 'BEGIN {
    itps = gen / ((g1 - g0) / 1000);
    hops = ring == "true" ? is : is + 1; # with the ring no hop through the broker
    hop = 2 * d / 1000; floor = hop > 0 && hops > 1 ? 1 / (hops * hop) : 0;
    printf "{\"bench\":\"wan\",\"kind\":\"infer\",\"case\":\"%s\",\"up_mbit\":%g,\"down_mbit\":%g,\"rtt_ms\":%g,", n, up, down, 4 * d;
    printf "\"stall\":\"%s\",\"infer_stages\":%d,\"ring\":%s,\"generated\":%d,\"infer_tokens_per_s\":%.2f,", st, is, ring, gen, itps;
    printf "\"infer_floor_tokens_per_s\":%.2f,\"infer_vs_floor\":%.2f,\"text_same_as_run\":%s}\n", floor,
      (floor > 0 ? itps / floor : 0), same }'
  stop_all
}

condition lan 1000 1000 0.05
condition 100mbit_20ms 100 100 5
condition 20mbit_60ms 20 20 15
condition 50_10mbit_40ms 10 50 10
condition stalls_1pct_2s 100 100 5 0.01:2
