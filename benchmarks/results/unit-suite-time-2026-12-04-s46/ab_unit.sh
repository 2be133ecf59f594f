#!/usr/bin/env bash
# helper-67: the unit phase exactly as `make test` runs it (pytest -q -n 3 --dist loadfile tests/unit),
# before (wt-rel-b) and after (wt-rel-a); a4 = after with -n 4. Each in a clean worktree (no __pycache__).
set -u
for side in ${ORDER:-b a b a}; do
  w=${side:0:1}; n=${side:1}; n=${n:-3}
  cd /tmp/wt-rel-$w
  find . -path ./.venv -prune -o -name __pycache__ -type d -print | grep -v "^./.venv" | xargs rm -rf
  rm -rf .pytest_cache
  echo "== $side $(git rev-parse --short HEAD) -n $n start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -f "$side wall %e s user %U sys %S" env PYTHONPATH=/tmp/wt-rel-$w .venv/bin/pytest -q -n $n --dist loadfile tests/unit 2>&1 | grep -E "passed|failed|error|wall" | grep -v "^tests/" | tail -4
  echo "   end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
