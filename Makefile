# preshard: the commands people and CI run. `make help` lists them.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVENV := $(BIN)/python -m preshard.devenv

.DEFAULT_GOAL := help
.PHONY: help install lint format crds test test-fast run dev-cluster dev-cluster-down \
        dev-cluster-status bench bench-serialize bench-load bench-controller bench-gpu lock clean

help: ## List the targets.
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-20s %s\n", $$1, $$2}'

# The virtualenv, with uv inside it so no global tool is needed. Reinstalled when the pinned
# requirements or the project's metadata change. It ends by checking that no two installed
# distributions claim one file (uv unpacks wheels in parallel; the last copy written would win).
$(STAMP): requirements/dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check 'uv>=0.9,<1'
	$(BIN)/uv pip sync --quiet --python $(BIN)/python requirements/dev.txt
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	$(DEVENV) check-install
	@touch $@

install: $(STAMP) ## Create .venv with the pinned dependencies.

lock: ## Re-pin requirements/dev.txt from pyproject.toml.
	$(BIN)/uv pip compile --quiet pyproject.toml --extra dataplane --extra vllm --extra dev \
	    --override requirements/overrides.txt --python-version 3.11 \
	    --python-platform x86_64-manylinux_2_28 --no-header -o requirements/dev.txt

lint: $(STAMP) ## ruff, ruff format --check, mypy --strict, and the generated-files check.
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m preshard.api.crd | diff -u crds/shardedmodels.preshard.dev.yaml - \
	    || (echo "crds/ is stale: run 'make crds'" && exit 1)

format: $(STAMP) ## Format and fix what ruff can.
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

crds: $(STAMP) ## Regenerate the CRD (crds/ and the chart) from the Pydantic models.
	$(BIN)/python -m preshard.api.crd > crds/shardedmodels.preshard.dev.yaml
	cp crds/shardedmodels.preshard.dev.yaml charts/preshard/files/crds/shardedmodels.preshard.dev.yaml

test: $(STAMP) ## The test suite: unit, data plane, control plane, Helm, end to end.
	$(BIN)/pytest

test-fast: $(STAMP) ## Only the tests that need no cluster and no S3 server.
	$(BIN)/pytest tests/unit

run: $(STAMP) ## Run the operator against the current kube context (or a local one).
	$(BIN)/python -m preshard.devenv run-operator

dev-cluster: $(STAMP) ## Start a local control plane, fake GPU nodes and an S3 server.
	$(DEVENV) up

dev-cluster-down: $(STAMP) ## Stop what `make dev-cluster` started.
	$(DEVENV) down

dev-cluster-status: $(STAMP) ## Show what `make dev-cluster` runs.
	$(DEVENV) status

bench: $(STAMP) ## Every CPU benchmark (minutes); results in benchmarks/results/.
	$(BIN)/python -m benchmarks.serialize
	$(BIN)/python -m benchmarks.load
	$(BIN)/python -m benchmarks.controller

bench-serialize: $(STAMP) ## Making shards: preshard vs boto3 vs tensorizer vs the server's limit.
	$(BIN)/python -m benchmarks.serialize

bench-load: $(STAMP) ## Loading shards: tensorizer num_readers vs a raw download.
	$(BIN)/python -m benchmarks.load

bench-controller: $(STAMP) ## The controller at scale on the local control plane.
	$(BIN)/python -m benchmarks.controller

bench-gpu: $(STAMP) ## GPU load benchmark (needs a CUDA GPU).
	$(BIN)/python benchmarks/gpu_load.py

clean: ## Remove the virtualenv and caches (not the binary cache).
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
