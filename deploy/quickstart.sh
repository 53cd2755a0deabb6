#!/usr/bin/env bash
# One command from a fresh clone to a fine-tuned adapter, the distributed way:
#   1. installs dependencies and builds (Release, build/release);
#   2. starts a broker and three peers on loopback (deploy/local-cluster.sh; SQLite under ./var/);
#   3. makes a small LLaMA-family model with `fusion model init`;
#   4. fine-tunes a LoRA-FA adapter on deploy/data/shakespeare.txt through the pipeline, printing the
#      loss as it falls, and downloads the adapter (PEFT format);
#   5. generates text through the pipeline with the new adapter;
#   6. stops everything it started. Run it again at will: it starts from scratch each time.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build/release}
VAR=${VAR:-var/quickstart}
STEPS=${STEPS:-100}
export FUSION_BIN="$BUILD_DIR/bin"
export CLUSTER_DIR="$VAR/cluster"
export FUSION_PORT=${FUSION_PORT:-7700}
BIN=$FUSION_BIN

./deploy/install-deps.sh
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target fusion fusion-broker fusion-peer

# A cluster left over from an interrupted run is stopped first; ours is stopped on any exit.
[ -d "$CLUSTER_DIR" ] && ./deploy/local-cluster.sh down >/dev/null || true
rm -rf "$VAR"
mkdir -p "$VAR"
trap './deploy/local-cluster.sh down' EXIT

echo "== starting a broker and three peers on loopback"
# The demo's own peers compute at normal priority: on a busy machine, guests (the default) would wait.
PEER_PRIORITY=normal ./deploy/local-cluster.sh up 3
export FUSION_CONFIG="$CLUSTER_DIR/client.conf"
"$BIN/fusion" peers

echo "== making a small model (4 layers, hidden 128, byte-level vocabulary)"
"$BIN/fusion" model init --layers 4 --hidden 128 --heads 4 --kv-heads 2 --ffn 352 --vocab 256 \
  --seed 1 -o "$VAR/model"

echo "== fine-tuning a LoRA-FA adapter through the pipeline ($STEPS steps)"
JOB=$("$BIN/fusion" submit finetune --model "$VAR/model" --data deploy/data/shakespeare.txt \
  --method lora-fa --rank 16 --alpha 32 --lr 3e-2 --steps "$STEPS" --batch 4 --micro-batches 2 \
  --seq-len 64 --checkpoint-every 10 --quiet)
echo "job $JOB"
"$BIN/fusion" wait "$JOB" 2>&1 | cat   # one line per step: the loss falling
"$BIN/fusion" status "$JOB"
"$BIN/fusion" result "$JOB" -o "$VAR/adapter"

echo "== generating through the pipeline with the new adapter"
"$BIN/fusion" submit infer --model "$VAR/model" --adapter-job "$JOB" --prompt "ROMEO:" \
  --max-tokens 96 --temperature 0.8 --top-k 20 --seed 1 --wait --quiet >"$VAR/generated.txt"
cat "$VAR/generated.txt"

echo
echo "quickstart: done. Adapter (PEFT format) in $VAR/adapter; the cluster's store and logs in $CLUSTER_DIR"
