#!/usr/bin/env bash
# One command from a fresh clone to a fine-tuned adapter: installs dependencies, builds (Release),
# makes a small LLaMA-family model, fine-tunes a LoRA-FA adapter on the text shipped in
# deploy/data/, prints the loss as it falls, then generates text with the new adapter.
#
# Until the broker and peer daemons land, the job runs in this process (`fusion run`); the
# distributed form (a local broker and three peers on loopback, SQLite under ./var/) replaces it
# when they do. Everything it makes lives under ./var/quickstart and is remade on each run.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build/release}
VAR=${VAR:-var/quickstart}
STEPS=${STEPS:-40}

./deploy/install-deps.sh
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target fusion fusion-broker fusion-peer
BIN="$BUILD_DIR/bin"

rm -rf "$VAR"
mkdir -p "$VAR"

echo "== making a small model (4 layers, hidden 128, byte-level vocabulary)"
"$BIN/fusion" model init --layers 4 --hidden 128 --heads 4 --kv-heads 2 --ffn 352 --vocab 256 \
  --seed 1 -o "$VAR/model"

echo "== fine-tuning a LoRA-FA adapter on deploy/data/shakespeare.txt ($STEPS steps)"
"$BIN/fusion" run finetune --model "$VAR/model" --data deploy/data/shakespeare.txt \
  --method lora-fa --rank 8 --alpha 16 --lr 1e-2 --steps "$STEPS" --batch 4 --seq-len 64 \
  --loss-log "$VAR/loss.jsonl" -o "$VAR/adapter"

echo "== generating with the new adapter"
"$BIN/fusion" run infer --model "$VAR/model" --adapter "$VAR/adapter" \
  --prompt "ROMEO:" --max-tokens 64 --seed 1

echo
echo "quickstart: done. Adapter (PEFT format) in $VAR/adapter, loss log in $VAR/loss.jsonl"
