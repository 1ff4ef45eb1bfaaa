# tokenfair — every command a newcomer or CI needs. Nothing is installed outside `.venv/`
# and the build cache (`$(TOKENFAIR_CACHE)`).
# Python 3.11: what CI and the image run (Debian 12's); python3 when no python3.11 is on PATH.
PYTHON ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The locks (`make lock`): every package pinned with its hashes, for the venv and the image.
LOCK := requirements/dev.txt
IMAGE_LOCK := requirements/image.txt
# Universal resolution (markers instead of this machine's answers): Debian 12's Python 3.11.2
# needs async-timeout where 3.11.3 and later do not. LOCK_FLAGS=--upgrade moves every pin.
UV_COMPILE := $(BIN)/uv pip compile --quiet --universal --python-version 3.11 --generate-hashes
export TOKENFAIR_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tokenfair

.PHONY: help venv native lock run simulate test lint format bench bench-fairness bench-simulate bench-sidecar bench-pool clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# Installing needs pip only: the lock with --require-hashes, then tokenfair itself, built by the
# locked setuptools. A changed lock reinstalls in place (`make clean venv` for an exact copy).
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; v = sys.version_info[:2]; v == (3, 11) or print( \
		f"make: warning: .venv runs Python {v[0]}.{v[1]}; CI, the image and $(LOCK) use 3.11", \
		file=sys.stderr)'
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP) native ## create .venv and install tokenfair with its dev tools (from the lock)

# The compiled core (docs/native.md): mypyc builds the scheduling core and the replay loop into
# .venv/tokenfair-native when their sources changed (~20 s); a process uses them only while
# those sources are as built, else the interpreted modules (the same decisions, slower). No C
# compiler: a warning, and the interpreted core runs; TOKENFAIR_REQUIRE_NATIVE=1 (CI) fails.
native: $(STAMP) ## compile the scheduling core with mypyc (~20 s; only when its sources changed)
	@$(BIN)/tokenfair native build --if-stale || { [ "$${TOKENFAIR_REQUIRE_NATIVE:-}" != 1 ] && \
		echo "make: warning: the compiled core did not build; the interpreted one runs" >&2; }

lock: $(STAMP) ## re-resolve requirements/*.txt after a pyproject.toml edit (uv; LOCK_FLAGS=--upgrade)
	UV_CUSTOM_COMPILE_COMMAND='make lock' $(UV_COMPILE) $(LOCK_FLAGS) \
		--extra dev --extra operator --extra plot --extra tracing -o $(LOCK) pyproject.toml requirements/build.in
	UV_CUSTOM_COMPILE_COMMAND='make lock' $(UV_COMPILE) --constraint $(LOCK) \
		--extra operator -o $(IMAGE_LOCK) pyproject.toml requirements/build.in

run: $(STAMP) native ## the main job: the sidecar standalone on the cost-model engine, lesson's tenants
	@echo "tokenfair sidecar: proxy http://127.0.0.1:8080, admin http://127.0.0.1:9090 (Ctrl-C stops)"
	@echo "local API keys (examples/local-keys.yaml):"
	@sed -n 's/^\(tenant_[a-z_]*\): \(.*\)/  \1  Authorization: Bearer \2/p' examples/local-keys.yaml
	@echo "drive the lesson's workload at it from another shell:"
	@echo "  $(BIN)/tokenfair loadgen --target http://127.0.0.1:8080 --scenario noisy-neighbor --keys examples/local-keys.yaml --stream"
	$(BIN)/tokenfair sidecar --config examples/sidecar-standalone.yaml

simulate: $(STAMP) native ## replay the lesson's noisy-neighbor fixture under every policy (no server)
	$(BIN)/tokenfair simulate --scenario noisy-neighbor

lint: $(STAMP) ## ruff check, ruff format --check, mypy --strict
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint native ## lint, then the whole test suite once (on the compiled core when built; tests/sidecar/native compares both cores)
	$(BIN)/pytest

format: $(STAMP) ## apply ruff's formatting and safe fixes
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP) native ## scheduling-core benchmarks (minutes; not part of the tests)
	$(BIN)/python bench/bench_core.py

bench-fairness: $(STAMP) native ## fairness scenario suite, every figure against its target (seconds)
	$(BIN)/python bench/bench_fairness.py

bench-simulate: $(STAMP) native ## `tokenfair simulate` end to end vs the lesson's lab, 200k/32k (~2 min; BENCH_ARGS=--million adds 1M)
	$(BIN)/python bench/bench_simulate.py $(BENCH_ARGS)

bench-sidecar: $(STAMP) native ## the sidecar against a minimal proxy (needs nginx, wrk; ~8 min)
	$(BIN)/python bench/bench_sidecar.py

bench-pool: $(STAMP) native ## pool-wide budgets on Redis vs the 1/n split (needs redis-server; ~5 min; BENCH_ARGS=--window 20)
	$(BIN)/python bench/bench_pool.py $(BENCH_ARGS)

clean: ## remove the virtualenv and caches of this checkout (not the build cache)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# The control plane and kubectl/helm for the Kubernetes-facing tests.
-include hack/controlplane.mk
# The node (kubelet, containerd, CNI) and the real image for the `node` tests.
-include hack/node.mk
-include hack/kind.mk
# vLLM's CPU build and a tiny model for the `vllm` tests (the real engine behind the sidecar).
-include hack/vllm.mk
