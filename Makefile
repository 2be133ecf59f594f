# gpupool: `make run` starts the stack on the embedded default, `make test` runs every check.
# Both set everything up first; a second run reinstalls nothing.

VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.gpupool-installed
MODEL   := .gpupool/models/tiny/config.json
PACKAGES := pools router gpu_probe kvcache_model benchmarks
# the unit tests on this many pytest-xdist workers (2 cores: 227 s instead of 438 s, measured
# back to back), each file on one worker (--dist loadfile). test_openapi.py runs in the
# serial session: schemathesis's per-operation cases collapse into one test under xdist, and
# its last test counts them. The integration and e2e tests run one at a time, their real
# engines share the CPU and the fleet is one per session.
UNIT_WORKERS ?= 2
XDIST := -n $(UNIT_WORKERS) --dist loadfile --ignore=tests/unit/test_openapi.py

.PHONY: all install run test lint typecheck unit integration e2e dev-model clean

all: test

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	@touch $@

$(MODEL): | $(STAMP)
	$(BIN)/gpupool dev-model --shape tiny --out .gpupool/models/tiny

dev-model: $(MODEL)

run: $(STAMP) $(MODEL)
	$(BIN)/gpupool up $(if $(CONFIG),--config $(CONFIG))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict $(PACKAGES)

unit: $(STAMP)
	$(BIN)/pytest -q $(XDIST) tests/unit
	$(BIN)/pytest -q tests/unit/test_openapi.py

integration: $(STAMP) $(MODEL)
	$(BIN)/pytest -q tests/integration

e2e: $(STAMP) $(MODEL)
	$(BIN)/pytest -q tests/e2e

# every test under tests/: the unit tests on workers, then the rest (test_openapi.py,
# integration, e2e, gpu) in one session. Each pytest fails the run when it collects no test
# (exit code 5) or when a process it started outlives it (tests/conftest.py).
test: $(STAMP) $(MODEL) lint typecheck
	$(BIN)/pytest -q $(XDIST) tests/unit
	$(BIN)/pytest -q tests/unit/test_openapi.py tests/integration tests/e2e tests/gpu

clean:
	rm -rf .gpupool/run .mypy_cache .ruff_cache .pytest_cache
