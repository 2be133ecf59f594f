#!/usr/bin/env bash
# Alternating before/after runs of one pytest command line in two clean worktrees, each run
# timed (wall, and the CPU of pytest and everything it waited for): run under the engines'
# lock, e.g.
#   flock /tmp/gpupool-engines.lock bash ab.sh /tmp/wt-before /tmp/wt-after 2 OUT \
#     -q -n 3 --dist loadfile tests/unit
# Prints one line per run: label, start time, load average, wall s, user+sys s, pytest's tail.
# FIRST=after starts with the after side (to continue an earlier run's alternation).
set -uo pipefail
before=$1 after=$2 pairs=$3 out=$4; shift 4
mkdir -p "$out"
for i in $(seq 1 "$pairs"); do
  for side in before after; do
    flip=$(( i % 2 == 0 ))
    if [ "${FIRST:-before}" = after ]; then flip=$(( 1 - flip )); fi
    if [ "$flip" -eq 1 ]; then side=$([ "$side" = before ] && echo after || echo before); fi
    wt=$([ "$side" = before ] && echo "$before" || echo "$after")
    log="$out/$side-$i.log"
    load=$(cut -d' ' -f1 /proc/loadavg); start=$(date -u +%H:%M:%S)
    (cd "$wt" && find . -name __pycache__ -not -path './.venv*' -prune -exec rm -rf {} + ;
     PYTHONPATH="$wt" /usr/bin/time -f '%e %U %S' -o "$log.time" \
       .venv/bin/pytest -p no:cacheprovider "$@" > "$log" 2>&1)
    read -r wall user sys < <(tail -1 "$log.time")
    echo "$side $i start $start load $load wall ${wall} cpu $(echo "$user + $sys" | bc) :: $(tail -1 "$log")"
  done
done
