#!/usr/bin/env bash
# A device-machine call that runs several benchmarks in sequence, each under its own time limit, so one
# slow case cannot eat the call: logs and results land in $OUT (what the device tool brings back).
#   bash bench/gpu_batch.sh "NAME SECONDS CMD..." "NAME SECONDS CMD..." ...
# Example: bash bench/gpu_batch.sh "startup 240 python bench/startup.py" "label 150 python bench/label.py --mode structured"
#
# Work longer than one call (10 minutes): start the queue detached, then collect in consecutive calls on the
# same warm machine (a detached process runs on until the machine goes back; each collect brings back what is
# finished so far, so nothing is lost if the lease ends early):
#   bash bench/gpu_batch.sh start "NAME SECONDS CMD..." ...      # returns at once
#   bash bench/gpu_batch.sh collect 560                          # waits until the queue ends or 560 s pass
# The queue runs in a copy of the tree outside the checkout ($Q/work): each device call re-sends the working
# tree and removes files it does not know, which once deleted a queue's logs and results mid-run.
#
# Several GPUs: a job spec that starts with "@K " (or "@K,L") runs in that lane with CUDA_VISIBLE_DEVICES=K (K,L); each lane runs its
# jobs in order, the lanes (and the jobs without a lane, all GPUs visible) run at the same time. On a machine of
# 4 GPUs this is four times the GPU-minutes of the same device time:
#   bash bench/gpu_batch.sh start "@0 ours 900 python bench/ppo_parity.py ..." "@1 theirs 900 python ..." ...
# A second queue beside a running one (say, lanes that wait for a file carried by a later call): give each a
# name, GPU_QUEUE_NAME=b bash bench/gpu_batch.sh start ...; collect names it the same way and brings back
# $OUT/batch-b.tgz (the unnamed queue: $OUT/batch.tgz).
set -u
OUT=${OUT:-/tmp/out}
Q=${GPU_QUEUE_DIR:-/tmp/tc-devq${GPU_QUEUE_NAME:+-$GPU_QUEUE_NAME}}
ARCHIVE=batch${GPU_QUEUE_NAME:+-$GPU_QUEUE_NAME}.tgz

pack() {  # the logs and every result file written since the queue started, in one archive ($OUT takes 8 files)
  local logs=$1
  # checkpoints stay behind: a 5-seed PPO run's (env states included) is 2.2 GB, over what $OUT brings back;
  # their commit record (checkpoint/latest.json: update, env steps, checksums) comes back, so that the run's
  # progress can be read here (bench/llm_features.py status / collect)
  find bench/results -newer "$logs/.start" -type f \( -not -path '*/checkpoint/*' -o -path '*/checkpoint/latest.json' \) \
    -size -40M > "$logs/new.txt"
  mkdir -p "$OUT"
  tar czf "$OUT/$ARCHIVE" -C "$logs" . -C "$PWD" -T "$logs/new.txt"
  echo "results written: $(tr '\n' ' ' < "$logs/new.txt")"
}

descendants() {  # every process under pid $1
  local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done
}

spy_later() {  # after $2 s, py-spy's native dump of every Python process under pid $1, appended to log $3
  sleep "$2"
  local spy; spy=$(command -v py-spy || ls /tmp/site/bin/py-spy 2>/dev/null) || return 0
  local p
  for p in $(descendants "$1"); do
    # by the command line, not comm: on the GPU machine the bench process's comm is not python* (the 2026-11-27
    # 2-GPU hang's dump covered its compile workers and skipped it, the one process that mattered)
    { tr '\0' ' ' < /proc/"$p"/cmdline; } 2>/dev/null | grep -q python || continue
    # which thread holds the GIL, and the native frames under each Python one: what faulthandler and a Python
    # timer cannot show when native code holds the interpreter lock (the 2-GPU async stalls, 2026-11-27)
    { echo; echo "=== py-spy dump --native of pid $p at $2 s"; "$spy" dump --native --pid "$p" 2>&1; } >> "$3"
  done
}

run_jobs() {  # one lane's jobs, in order
  local logs=$1; shift
  for spec in "$@"; do
    read -r name limit cmd <<<"$spec"
    echo "=== $name (limit ${limit}s${CUDA_VISIBLE_DEVICES:+, GPU $CUDA_VISIBLE_DEVICES}): $cmd"
    t0=$(date +%s)
    # a Python bench still running 20 s before the limit prints every thread's stack into its log (bench/common.py),
    # and 30 s before it py-spy (carried in .whl/) dumps its native stacks and the GIL holder there too
    THINKCRAFT_STACK_DUMP_S=$(( limit > 60 ? limit - 20 : limit )) \
      timeout --signal=INT --kill-after=15 "$limit" bash -c "$cmd" >"$logs/$name.log" 2>&1 &
    local job=$! spy=
    if (( limit > 60 )); then spy_later "$job" $(( limit - 30 )) "$logs/$name.log" & spy=$!; fi
    wait "$job"
    rc=$?
    [ -n "$spy" ] && { pkill -P "$spy" 2>/dev/null; kill "$spy" 2>/dev/null; }
    echo "    rc=$rc in $(( $(date +%s) - t0 )) s"; tail -n 25 "$logs/$name.log"
  done
}

run_queue() {
  local logs=$1; shift
  source bench/gpu_env.sh
  local -A lanes=()
  local plain=() spec lane
  for spec in "$@"; do
    if [[ $spec =~ ^@([0-9,]+)[[:space:]]+(.*)$ ]]; then
      lane=${BASH_REMATCH[1]}; lanes[$lane]+="${BASH_REMATCH[2]}"$'\x1f'
    else
      plain+=("$spec")
    fi
  done
  if [ ${#lanes[@]} -eq 0 ]; then run_jobs "$logs" "${plain[@]}"; return; fi
  local pids=()
  for lane in "${!lanes[@]}"; do
    IFS=$'\x1f' read -r -a specs <<<"${lanes[$lane]}"
    (export CUDA_VISIBLE_DEVICES=$lane; run_jobs "$logs" "${specs[@]}" > "$logs/lane-$lane.txt" 2>&1) &
    pids+=($!)
  done
  [ ${#plain[@]} -gt 0 ] && { run_jobs "$logs" "${plain[@]}" > "$logs/lane-all.txt" 2>&1 & pids+=($!); }
  wait "${pids[@]}"
  for f in "$logs"/lane-*.txt; do echo "--- ${f##*/}"; cat "$f"; done
}

case "${1:-}" in
  start)
    shift
    rm -rf "$Q"; mkdir -p "$Q/logs" "$Q/work"; touch "$Q/logs/.start"
    tar cf - --exclude=./.git --exclude=./.venv --exclude=./.cache . | tar xf - -C "$Q/work"
    # the subshell's own descriptors too: it waits for setsid (which execs, not forks, outside a group leader),
    # and a caller's pipe (`... start ... | tail`) stayed open until the queue ended (a device call hung, 2026-11-27)
    (cd "$Q/work" && setsid nohup bash -c 'bash bench/gpu_batch.sh __queue "$@" > "$0/logs/queue.log" 2>&1; touch "$0/done"' \
      "$Q" "$@" &) </dev/null >/dev/null 2>&1
    echo "queue started in $Q/work: $# jobs; collect with: bash bench/gpu_batch.sh collect SECONDS"
    ;;
  __queue)
    shift; run_queue "$Q/logs" "$@"
    ;;
  collect)
    limit=${2:-560}; t0=$(date +%s)
    while [ ! -e "$Q/done" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
    [ -e "$Q/done" ] && echo "queue finished" || echo "queue still running after ${limit}s"
    cat "$Q/logs/queue.log"
    [ -e "$Q/done" ] || for f in "$Q"/logs/lane-*.txt; do [ -e "$f" ] && { echo "--- ${f##*/} (so far)"; cat "$f"; }; done
    (cd "$Q/work" && pack "$Q/logs")
    ;;
  *)
    LOGS=$(mktemp -d); touch "$LOGS/.start"
    run_queue "$LOGS" "$@"
    pack "$LOGS"
    ;;
esac
