#!/usr/bin/env bash
# helper-67: the SRE-move test (witness version, scratch timing print) 4 times in one fleet, under 4 busy loops
set -u
cd /tmp/wt-rel-fix
pids=()
for i in 1 2 3 4; do timeout 900 python3 -c "while True: pass" & pids+=($!); done
uptime
GPUPOOL_TEST_ENGINE_BASE_PORT=8950 REPEAT=${N:-4} PYTHONPATH=$PWD:/tmp/rel timeout 800 .venv/bin/pytest -p repeatplug -q -s -p no:cacheprovider tests/integration/test_rebalance_real.py -k sre --durations=10 2>&1 | grep -vE "^\s*$" | tail -30
uptime
for p in "${pids[@]}"; do kill $p; done
