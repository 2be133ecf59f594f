#!/usr/bin/env bash
# What the OpenAPI property tests find at each count of generated cases per operation:
# one run per count, the router in-process under coverage.py (installed apart, COVPKG), each
# case's outcome written by outcomeplug.py. Usage, from a worktree of the commit measured:
#   COVPKG=/tmp/h77/covpkg OUT=/tmp/h77/counts bash openapi_counts.sh 120 40 20
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
for n in "$@"; do
  out="$OUT/n$n"; rm -rf "$out"; mkdir -p "$out"
  start=$(date +%s.%N)
  PYTHONPATH="$here:$PWD:$COVPKG" OUTCOMES="$out/outcomes.jsonl" OPENAPI_EXAMPLES="$n" \
    COVERAGE_FILE="$out/.coverage" .venv/bin/python -m coverage run --branch \
    --source=router,pools -m pytest -q -p no:cacheprovider -p outcomeplug \
    tests/unit/test_openapi.py tests/unit/test_openapi_admin.py > "$out/pytest.log" 2>&1 || true
  end=$(date +%s.%N)
  tail -1 "$out/pytest.log"
  PYTHONPATH="$COVPKG" COVERAGE_FILE="$out/.coverage" .venv/bin/python -m coverage json \
    -q -o "$out/coverage.json"
  echo "n=$n wall $(echo "$end - $start" | bc) s (under coverage)"
done
