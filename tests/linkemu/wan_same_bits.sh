#!/usr/bin/env bash
# A three-stage fine-tune over 20 Mbit/s links with a 60 ms round trip (bench/wan's condition, quick)
# finishes with the LAN run's adapter bit for bit (the wire carries f32), and generation over those
# links reaches at least 80% of the latency floor. Exits 77 (skipped) where bench/wan cannot run.
#
#   tests/linkemu/wan_same_bits.sh BUILD_DIR
set -uo pipefail
out=$("$(dirname "$0")/../../bench/wan/run.sh" "$1" --quick --only 20mbit_60ms)
rc=$?
echo "$out"
[ $rc = 77 ] && exit 77
[ $rc = 0 ] || { echo "wan: bench/wan failed ($rc)"; exit 1; }
line=$(echo "$out" | grep '"case":"20mbit_60ms"')
[ -n "$line" ] || { echo "wan: no 20mbit_60ms line"; exit 1; }
echo "$line" | grep -q '"stages":3,' || { echo "wan: the fine-tune did not run as three stages"; exit 1; }
echo "$line" | grep -q '"adapter_same_as_lan":true' || { echo "wan: the adapter differs from the LAN run's"; exit 1; }
vs=$(echo "$line" | sed -n 's/.*"infer_vs_floor":\([0-9.]*\).*/\1/p')
awk -v v="$vs" 'BEGIN { exit !(v >= 0.8) }' || { echo "wan: generation at $vs of the latency floor (< 0.8)"; exit 1; }
echo "wan: three stages over 20 Mbit/s, 60 ms: the LAN adapter bit for bit; generation at $vs of the floor"
