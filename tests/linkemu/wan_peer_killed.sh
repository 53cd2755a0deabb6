#!/usr/bin/env bash
# A peer killed mid-job over the slow link recovers as on LAN: over 20 Mbit/s links with a 60 ms round
# trip, the peer of stage 1 of a three-stage fine-tune (f32 on the wire, a checkpoint every 2 steps,
# a fourth peer as backup) is killed halfway; the job still ends with the LAN run's adapter bit for bit.
# Exits 77 (skipped) where bench/wan cannot run.
#
#   tests/linkemu/wan_peer_killed.sh BUILD_DIR
set -uo pipefail
out=$("$(dirname "$0")/../../bench/wan/run.sh" "$1" --quick --only 20mbit_60ms --codecs f32 --kill)
rc=$?
echo "$out"
[ $rc = 77 ] && exit 77
[ $rc = 0 ] || { echo "wan: bench/wan failed ($rc)"; exit 1; }
line=$(echo "$out" | grep '"case":"20mbit_60ms","codec":"f32"')
[ -n "$line" ] || { echo "wan: no 20mbit_60ms line"; exit 1; }
echo "$line" | grep -q '"killed_at_step":[0-9]' || { echo "wan: no peer was killed"; exit 1; }
echo "$line" | grep -q '"adapter_same_as_lan":true' || { echo "wan: after the kill the adapter differs from LAN's"; exit 1; }
echo "wan: stage 1's peer killed at step $(echo "$line" | sed -n 's/.*"killed_at_step":\([0-9]*\).*/\1/p') over 20 Mbit/s," \
  "60 ms: the LAN adapter bit for bit"
