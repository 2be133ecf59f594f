# gpupool: `make run` starts the stack on the embedded default, `make test` runs every check.
# Both set everything up first; a second run reinstalls nothing.

VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.gpupool-installed
MODEL   := .gpupool/models/tiny/config.json
PACKAGES := pools router gpu_probe kvcache_model benchmarks
# the unit tests on this many pytest-xdist workers, each file on one worker (--dist loadfile).
# Many of them wait (on sockets, subprocesses, timers) more than they compute: on 2 cores,
# 3 workers ran them with test_openapi.py in 2 min 7 s to 2 min 26 s, where 2 workers took
# 2 min 10 s and test_openapi.py another ~50 s alone. The integration and e2e tests run one at
# a time, their real engines share the CPU and the fleet is one per session.
UNIT_WORKERS ?= 3
XDIST := -n $(UNIT_WORKERS) --dist loadfile

.PHONY: all install compiled run test lint typecheck unit unit-tie integration e2e dev-model clean

all: test

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	@touch $@

$(MODEL): | $(STAMP)
	$(BIN)/gpupool dev-model --shape tiny --out .gpupool/models/tiny

dev-model: $(MODEL)

# the request path's hot modules compiled with mypyc into build/compiled/ (router/_compiled.py
# loads them only while every source they were built from is unchanged; GPUPOOL_PURE=1 runs the
# Python). The script does nothing when the build is current; it rebuilds when a source in the
# build's import closure changed. A failed build: the router runs as Python with a warning,
# except under CI=true, where it fails the target (CI must not test the pure path unawares).
compiled: $(STAMP)
	@$(BIN)/python scripts/build_compiled.py --jobs 2 || { \
	  if [ "$$CI" = true ]; then echo "make compiled: the mypyc build failed (CI=true)" >&2; exit 1; fi; \
	  echo "make compiled: the mypyc build failed; the router runs as Python" >&2; }

run: $(STAMP) $(MODEL) compiled
	$(BIN)/gpupool up $(if $(CONFIG),--config $(CONFIG))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the tests too (s48): +~55 s from a cold cache on 2 cores (tests/README.md "s48")
typecheck: $(STAMP)
	$(BIN)/mypy --strict $(PACKAGES) tests

unit: $(STAMP) compiled
	$(BIN)/pytest -q $(XDIST) tests/unit

# the unit tests twice, the picker's random tie-break forced to the first and then the last of
# the tied instances (tests/tools/tieplug.py): a test that fails in one of them leans on the
# coin. Not part of `make test`.
unit-tie: $(STAMP) compiled
	TIE=first PYTHONPATH=tests/tools $(BIN)/pytest -q -p tieplug --timeout 180 $(XDIST) tests/unit
	TIE=last PYTHONPATH=tests/tools $(BIN)/pytest -q -p tieplug --timeout 180 $(XDIST) tests/unit

integration: $(STAMP) $(MODEL) compiled
	$(BIN)/pytest -q tests/integration

e2e: $(STAMP) $(MODEL) compiled
	$(BIN)/pytest -q tests/e2e

# every test under tests/: the unit tests on workers, then the rest (integration, e2e, gpu) in
# one session. Each pytest fails the run when it collects no test
# (exit code 5) or when a process it started outlives it (tests/conftest.py).
test: $(STAMP) $(MODEL) lint typecheck compiled
	$(BIN)/pytest -q $(XDIST) tests/unit
	$(BIN)/pytest -q --durations=20 tests/integration tests/e2e tests/gpu

clean:
	rm -rf .gpupool/run .mypy_cache .ruff_cache .pytest_cache build/compiled
