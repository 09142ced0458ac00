#!/usr/bin/env bash
# A device-machine call that runs several benchmarks in sequence, each under its own time limit, so one
# slow case cannot eat the call: logs and results land in $OUT (what the device tool brings back).
#   bash bench/gpu_batch.sh "NAME SECONDS CMD..." "NAME SECONDS CMD..." ...
# Example: bash bench/gpu_batch.sh "startup 240 python bench/startup.py" "label 150 python bench/label.py --mode structured"
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOGS=$(mktemp -d); touch "$LOGS/.start"
source bench/gpu_env.sh
for spec in "$@"; do
  read -r name limit cmd <<<"$spec"
  echo "=== $name (limit ${limit}s): $cmd"
  t0=$(date +%s)
  timeout --signal=INT --kill-after=15 "$limit" bash -c "$cmd" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "    rc=$rc in $(( $(date +%s) - t0 )) s"; tail -n 25 "$LOGS/$name.log"
done
# one archive back (the tool returns at most 8 files): the logs and every result file this call wrote
find bench/results -newer "$LOGS/.start" -type f > "$LOGS/new.txt"
tar czf "$OUT/batch.tgz" -C "$LOGS" . -C "$PWD" $(cat "$LOGS/new.txt")
echo "results written: $(tr '\n' ' ' < "$LOGS/new.txt")"
