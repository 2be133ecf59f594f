#!/usr/bin/env bash
# Installs the peers the router-overhead benchmark compares gpupool with, each in its own
# git-ignored venv under .venv-peers/ (never into .venv, never committed):
#   vllmrouter  vllm-project's Rust router (PyPI: vllm-router)
#   litellm     LiteLLM's proxy (PyPI: litellm[proxy])
#   pstack      vLLM production-stack's Python router: needs Python >= 3.12 and a source
#               snapshot at third_party/production-stack (git-ignored); pass a production-stack
#               git dir as $1 to extract one (`git archive HEAD src`)
#   pyspy       py-spy, for the profile of gpupool
# Usage: bash benchmarks/router_overhead/setup_peers.sh [PRODUCTION_STACK_GIT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PY312=${PYTHON312:-python3.12}
mkdir -p .venv-peers third_party

venv() {  # venv NAME PYTHON PACKAGES...
  local name=$1 py=$2; shift 2
  [ -x ".venv-peers/$name/bin/python" ] || "$py" -m venv ".venv-peers/$name"
  ".venv-peers/$name/bin/pip" install -q "$@"
}

venv vllmrouter "$PY" vllm-router
venv litellm "$PY" 'litellm[proxy]'
venv pyspy "$PY" py-spy

if [ $# -ge 1 ]; then
  rm -rf third_party/production-stack && mkdir -p third_party/production-stack
  git --git-dir="$1" archive HEAD src pyproject.toml | tar -x -C third_party/production-stack
  git --git-dir="$1" rev-parse HEAD > third_party/production-stack/COMMIT
fi
if [ -f third_party/production-stack/src/vllm_router/requirements.txt ]; then
  # uvloop + httptools: what its image gets through vLLM; uvicorn picks them up when present
  venv pstack "$PY312" -r third_party/production-stack/src/vllm_router/requirements.txt \
    uvloop httptools
else
  echo "production-stack: no snapshot at third_party/production-stack; the benchmark will" \
       "report it as not installed" >&2
fi
