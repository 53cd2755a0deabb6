#!/usr/bin/env bash
# A three-stage fine-tune over 20 Mbit/s links with a 60 ms round trip (bench/wan's condition, quick)
# finishes with the LAN run's adapter bit for bit when the wire carries f32, and with int8 activations
# and gradients on the wire with the adapter of `fusion run finetune --cuts` (the plan's cuts) with the
# same codec in one process, bit for bit; a three-stage generation over those links, its tokens sent
# straight from the last stage to stage 0 (the ring), gives `fusion run infer`'s text at at least 80%
# of the latency floor. Exits 77 (skipped) where bench/wan cannot run.
#
#   tests/linkemu/wan_same_bits.sh BUILD_DIR
set -uo pipefail
out=$("$(dirname "$0")/../../bench/wan/run.sh" "$1" --quick --only 20mbit_60ms --codecs "f32 int8")
rc=$?
echo "$out"
[ $rc = 77 ] && exit 77
[ $rc = 0 ] || { echo "wan: bench/wan failed ($rc)"; exit 1; }
f32=$(echo "$out" | grep '"case":"20mbit_60ms","codec":"f32"')
int8=$(echo "$out" | grep '"case":"20mbit_60ms","codec":"int8"')
gen=$(echo "$out" | grep '"kind":"infer","case":"20mbit_60ms"')
[ -n "$f32" ] && [ -n "$int8" ] && [ -n "$gen" ] || { echo "wan: a 20mbit_60ms line is missing"; exit 1; }
for line in "$f32" "$int8"; do
  echo "$line" | grep -q '"stages":3,' || { echo "wan: a fine-tune did not run as three stages: $line"; exit 1; }
done
echo "$f32" | grep -q '"adapter_same_as_lan":true' || { echo "wan: f32: the adapter differs from the LAN run's"; exit 1; }
echo "$int8" | grep -q '"adapter_same_as_run":true' ||
  { echo "wan: int8: the adapter differs from fusion run --cuts --wire-codec int8's"; exit 1; }
echo "$gen" | grep -q '"infer_stages":3,"ring":true,' ||
  { echo "wan: the generation did not run as three stages with the last stage's tokens straight to stage 0: $gen"; exit 1; }
echo "$gen" | grep -q '"text_same_as_run":true' || { echo "wan: the generated text differs from fusion run infer's"; exit 1; }
vs=$(echo "$gen" | sed -n 's/.*"infer_vs_floor":\([0-9.]*\).*/\1/p')
awk -v v="$vs" 'BEGIN { exit !(v >= 0.8) }' || { echo "wan: generation at $vs of the latency floor (< 0.8)"; exit 1; }
echo "wan: three stages over 20 Mbit/s, 60 ms: f32 = the LAN adapter, int8 = fusion run --cuts with int8, bit for bit;" \
  "three-stage generation over the ring at $vs of the floor, fusion run infer's text"
