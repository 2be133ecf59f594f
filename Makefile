# gpupool: `make run` starts the stack on the embedded default, `make test` runs every check.
# Both set everything up first; a second run reinstalls nothing.

VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.gpupool-installed
MODEL   := .gpupool/models/tiny/config.json
PACKAGES := pools router gpu_probe kvcache_model benchmarks

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
	$(BIN)/pytest -q tests/unit

integration: $(STAMP) $(MODEL)
	$(BIN)/pytest -q tests/integration

e2e: $(STAMP) $(MODEL)
	$(BIN)/pytest -q tests/e2e

test: $(STAMP) $(MODEL) lint typecheck
	$(BIN)/pytest -q tests

clean:
	rm -rf .gpupool/run .mypy_cache .ruff_cache .pytest_cache
