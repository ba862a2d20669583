# The kit's entry points. `make help` lists them. Pins come from pins.toml only.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# var PYTHON: the Python 3.11 that make setup builds .venv with (default python3.11)
PYTHON ?= python3.11
VENV_PY := .venv/bin/python
# The one kit command (kit/cli.py); also .venv/bin/kit once make setup installed the kit.
KIT := $(VENV_PY) -m kit.cli
TREE_NAMES := unpatched patched

.PHONY: stress help setup test lint mods-list mods-drift regress upstream-suite upstream-check record-upstream tiny-model bench bench-cpu \
  turn-cost bench-gb10 bench-strix bench-cpu-image test-gb10 test-strix test-cpu report clean \
  lock-models fetch-models verify-models export-models import-models \
  build-gb10 build-strix build-cpu lint-images setup-host lock lock-deps

help: ## list the targets and the variables they take, one line each
	@echo "targets:"
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  %-20s %s\n", $$1, $$2}'
	@echo; echo "variables (make <target> NAME=value):"
	@grep -hE '^# var [A-Z_]+: ' $(MAKEFILE_LIST) | \
	  sed -E 's/^# var ([A-Z_]+): /\1\t/' | awk -F'\t' '{printf "  %-20s %s\n", $$1, $$2}'
	@echo; echo "every job is also 'kit <job>' (.venv/bin/kit --help, or $(KIT) --help)"

setup: ## create .venv with the pinned CPU vLLM and torch (from locks/cpu-venv-<arch>.txt), and the unpatched/patched trees
	$(PYTHON) -m kit.vllm_tree.setup_env

# var HOST_PYTHON: the Python 3.11 or 3.12 of setup-host (default: python3.12, else python3.11)
HOST_PYTHON ?= $(or $(shell for p in python3.12 python3.11; do $$p -c '' 2>/dev/null && { echo $$p; break; }; done),python3)

setup-host: ## GPU hosts: .venv with the kit, the Docker SDK and huggingface_hub only (vLLM runs in the images)
	$(HOST_PYTHON) -m kit.vllm_tree.setup_env --light

# var TORCH_INDEX: the PyTorch CPU wheel index of setup and lock-deps (default pins.toml [cpu] torch_index; TORCH_INDEX= : pip's own)
# (make hands a command-line TORCH_INDEX to the commands' environment itself.)

lock: setup-host ## (online, once) resolve every unresolved pin (TARGET=gb10|strix|cpu: one target's): base-image digests, vLLM commits, enabled models; saves each, prints the diff
	$(VENV_PY) -m kit.pins.lock pins $(TARGET)

# lock-deps needs no .venv (kit/pins/lock.py is standard library only): it makes setup-host's own lock.
lock-deps: ## (online) re-resolve the hash locks under locks/ (per image release: gb10 aarch64/x86_64, strix; the CPU .venv, setup-host's per platform) with uv
	$(HOST_PYTHON) -m kit.pins.lock deps

# Each phase prints its time. The whole suite runs on the patched tree; the tests
# marked `tree` (they measure the vLLM tree under test) run on the unpatched one too.
PHASE = bash -c 'start=$$(date +%s); "$${@:2}"; rc=$$?; \
  echo "== $$1: $$( [ $$rc -eq 0 ] && echo passed || echo FAILED ) in $$(( $$(date +%s) - start )) s"; \
  exit $$rc' phase

# var TESTS: pytest arguments for make test instead of the whole suite (paths, node ids, -k "expr"); with TESTS= only those run, on the patched tree
TESTS ?=

test: setup lint ## everything CI runs: lint, the suite (tree-dependent tests on both trees), vLLM's own v1 core suite on every tree of the pinned and the newest release (TESTS="...": only those tests)
ifneq ($(strip $(TESTS)),)
	@$(PHASE) "pytest $(TESTS), patched tree" \
	  env KIT_TREE=patched $(VENV_PY) -m pytest -q -p no:cacheprovider $(TESTS)
else
	@$(PHASE) "pytest, patched tree, every test" \
	  env KIT_TREE=patched $(VENV_PY) -m pytest -q -p no:cacheprovider
	@$(PHASE) "pytest, unpatched tree, tests marked tree" \
	  env KIT_TREE=unpatched $(VENV_PY) -m pytest -q -p no:cacheprovider -m tree
	@$(PHASE) "vLLM's v1 core suite, pinned release, pristine/unpatched/patched (the modded trees read from a container-flow run on the same code when there is one)" \
	  $(VENV_PY) -m kit.vllm_tree.upstream_suite --reuse-flow --results-root $(TEST_OUT)/upstream-suite
	@$(PHASE) "vLLM's v1 core suite, newest release, pristine/unpatched/patched" \
	  $(VENV_PY) -m kit.vllm_tree.upstream_suite --vllm newest --results-root $(TEST_OUT)/upstream-suite
	@$(PHASE) "upstream changes: each patch on pristine vLLM, its new tests without and with it, the v1 core suite" \
	  $(VENV_PY) -m kit.vllm_tree.upstream_check --suite-results $(TEST_OUT)/upstream-suite --out $(TEST_OUT)/upstream-check.json
endif

# make test leaves a clean checkout clean: its suites write under .cache/ (ignored);
# the committed record under results/ is written by the targets named for it
# (upstream-suite, upstream-check, record-upstream). tests/test_test_outputs.py checks.
TEST_OUT = .cache/test-results

lint: setup ## ruff over the kit's Python
	$(VENV_PY) -m ruff check kit tests
	$(VENV_PY) -m ruff format --check kit tests

mods-drift: setup ## every mod against every known vLLM release: applies / applied / drift, still needed
	$(KIT) mods-drift

mods-list: setup ## the mods and their state against both trees
	@for tree in $(TREE_NAMES); do $(KIT) mods list --tree .trees/$$tree/vllm; done

# The main job: the GPU target this host is, else the CPU default. A GPU alone does
# not make a host a DGX Spark: gb10 needs an aarch64 host whose nvidia-smi names a
# GB10 (ARCH=x86_64 asks for the CUDA sibling on an x86_64 NVIDIA host); strix
# needs /dev/kfd and an x86_64 host. TARGET_HOST=cpu|gb10|strix overrides.
# var TARGET_HOST: the target make bench runs: cpu, gb10 or strix (default: this host's, see above)
GPU_NAMES := $(shell nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)
MACHINE := $(shell uname -m)
TARGET_HOST ?= $(strip \
  $(if $(and $(filter aarch64,$(MACHINE)),$(findstring GB10,$(GPU_NAMES))),gb10, \
  $(if $(and $(filter x86_64,$(ARCH)),$(GPU_NAMES)),gb10, \
  $(if $(and $(filter x86_64,$(MACHINE)),$(wildcard /dev/kfd)),strix,cpu))))
HOST_TARGET := $(TARGET_HOST)
# var REPS: repetitions per context length (bench, bench-<target>; default 10)
REPS ?= 10
# var BENCH_ARGS: more arguments for the CPU bench (kit bench --help), e.g. --record-only or "--checkpoints split"
BENCH_ARGS ?=
# var CHECKPOINTS: the CPU checkpoint path of bench-cpu, bench-cpu-image and turn-cost: internal (default: the GDN layers export the state, budget 8192) or split (chunk ends, budget 2048)
CHECKPOINTS ?=
CHECKPOINT_OPT = $(if $(CHECKPOINTS),--checkpoints $(CHECKPOINTS))

bench: bench-$(HOST_TARGET) ## the main job: cached follow-up TTFT, unpatched vs patched, on this host's target

# A variable given on the command line or in the environment that a target would
# ignore is refused instead: $(call refuse,TARGET,VAR ...,what to use).
given = $(strip $(foreach v,$(1),$(if $(filter command line environment,$(origin $(v))),$(v))))
refuse = $(if $(call given,$(2)),@echo "error: make $(1) ignores $(call given,$(2)); $(3)" >&2; exit 2)

# The container flow's variables that mean the same on the host (DRY_RUN=1: print the
# servers' arguments and start nothing).
CPU_BENCH_OPTS = $(if $(SHARED),--shared $(SHARED)) $(if $(VLLM),--vllm $(VLLM)) \
  $(if $(MODEL),--model $(MODEL)) $(if $(filter 1,$(ONE_SERVER)),--one-server) \
  $(if $(BLOCK_REPS),--block-reps $(BLOCK_REPS)) $(if $(filter 1,$(DRY_RUN)),--print-serve-args)

bench-cpu: setup ## TTFT comparison on the CPU default (tiny model, MTP; internal checkpoint path unless CHECKPOINTS=split or BENCH_ARGS="--checkpoints split"; BENCH_ARGS="--arch qwen3_5_moe": the primary model's architecture), REPS= repetitions; writes results/<date>-cpu-<id>/
	$(call refuse,bench-cpu,TURN_REPS TURN_ARGS NODES ENGINE HOST_RECORD SOURCE_BUILD BASE_IMAGE,the CPU bench takes REPS= SHARED= CHECKPOINTS= VLLM= MODEL= ONE_SERVER= BLOCK_REPS= DRY_RUN= BENCH_ARGS= (the others are make turn-cost's or the container flow's))
	$(KIT) bench --reps $(REPS) $(CHECKPOINT_OPT) $(CPU_BENCH_OPTS) $(BENCH_ARGS)

# var TURN_REPS: repetitions per tree and round of turn-cost (default 5)
TURN_REPS ?= 5
# var TURN_ARGS: more arguments for turn-cost, e.g. --one-process (both sides in one process: the patched tree with the fix off and on; results/turn-cost-<path>-one-process.json)
TURN_ARGS ?=

turn-cost: setup ## where a conversation turn's time goes, unpatched vs patched (TURN_REPS= per tree and round; CHECKPOINTS=split for the split path; TURN_ARGS=--one-process: one process, the fix off and on); results/turn-cost-<path>.json
	$(call refuse,turn-cost,REPS BENCH_ARGS,TURN_REPS= and TURN_ARGS= set turn-cost (REPS and BENCH_ARGS are make bench's))
	$(KIT) turn-cost --reps $(TURN_REPS) $(CHECKPOINT_OPT) $(TURN_ARGS)

loss-sweep: setup ## EAGLE-specific loss over 20,000 seeded random geometries, from the geometry model; results/loss-sweep.json
	$(KIT) loss-sweep

# vLLM's kernels run in .venv-triton (kit/kernels/triton_env.py builds it), never in .venv.
.PHONY: kernel-check
kernel-check: setup ## the kit's CPU kernels (align copies, CPU GDN) against vLLM's own Triton kernels under Triton's interpreter; results/kernel-check.json
	$(KIT) kernel-check --out results/kernel-check.json

# device-check needs no .venv and no network: the bundle under kit/kernels/device_bundle
# (written by `kit kernel-check --export`) holds the cases and vLLM's kernel files.
# var DEVICE_PYTHON: the Python of device-check, with torch and Triton (default python3)
DEVICE_PYTHON ?= python3
.PHONY: device-check
device-check: ## on a GPU machine: the same checks with vLLM's compiled Triton kernels (0.32.0; FLA and SSD also 0.34.0, FLA also 0.34.0's patched tree), from the repository alone; results/kernel-check-cuda.json (DRY_RUN=1: interpreter, CPU, tiny cases)
	$(DEVICE_PYTHON) kit/kernels/triton_check.py --bundle kit/kernels/device_bundle \
	  $(if $(filter 1,$(DRY_RUN)),--dry-run --out .cache/device-check-dry-run.json,--device cuda --out results/kernel-check-cuda.json)

# var BUNDLES: one results folder, or two to compare (report; default the newest bundle)
BUNDLES ?= $(patsubst %/bench.json,%,$(lastword $(sort $(wildcard results/*/bench.json))))

report: setup ## render BUNDLES="results/A [results/B]" (default: the newest CPU bundle) as Markdown
	$(KIT) report $(BUNDLES)

# The container flow (kit/images/orchestrate.py): host check, images built or reused,
# models verified offline, both suites inside both images, the TTFT comparison
# on an isolated network, one bundle under results/.
# var ENGINE: the container engine of the flow: auto, docker or buildah (default auto)
ENGINE ?= auto
# var NODES: machines of the container flow (default 1)
NODES ?= 1
# var SHARED: context lengths S of the bench (CPU and container flow), e.g. SHARED="1007 2159"
SHARED ?=
# VLLM=<release>: gb10/strix images of that release (0.34.0 by default, pins.toml
# [images.<target>] vllm; VLLM=0.32.0 the pinned one); the cpu image has the pinned one only.
# var ARCH: gb10's image platform: aarch64 (DGX Spark) or x86_64 (the CUDA sibling; default: this host's)
# var SOURCE_BUILD: SOURCE_BUILD=1 compiles vLLM in the gb10 image instead of the locked wheel
# var DRY_RUN: DRY_RUN=1 checks host and pins and prints the commands bench-<target> would run (bench-cpu: the servers' arguments)
# var HOST_RECORD: (with DRY_RUN=1) a recorded host folder, e.g. tests/data/hosts/gb10-ok
IMAGE_OPTS = $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(VLLM),--vllm $(VLLM)) \
  $(if $(ARCH),--arch $(ARCH)) $(if $(filter 1,$(SOURCE_BUILD)),--source-build)
ORCH = $(VENV_PY) -m kit.images.orchestrate --engine $(ENGINE) $(if $(MODEL),--model $(MODEL)) \
  $(IMAGE_OPTS) $(if $(filter 1,$(DRY_RUN)),--dry-run) \
  $(if $(HOST_RECORD),--recorded-host $(HOST_RECORD))
# var ONE_SERVER: ONE_SERVER=1: the flow's servers one at a time, the trees in alternating blocks (chosen by itself where two do not fit)
# var BLOCK_REPS: repetitions per block with one server at a time (default 2)
ORCH_BENCH = --reps $(REPS) --nodes $(NODES) $(if $(SHARED),--shared $(SHARED)) $(CHECKPOINT_OPT) \
  $(if $(filter 1,$(ONE_SERVER)),--one-server) $(if $(BLOCK_REPS),--block-reps $(BLOCK_REPS))

bench-gb10: setup-host ## DGX Spark: host check, images (vLLM 0.34.0; VLLM=0.32.0), offline models, suites and TTFT in containers, bundle
	$(call refuse,bench-gb10,BENCH_ARGS TURN_REPS TURN_ARGS,the container flow takes REPS= SHARED= CHECKPOINTS= MODEL= NODES= ONE_SERVER=)
	$(ORCH) gb10 $(ORCH_BENCH)

bench-strix: setup-host ## Strix Halo: host check, images (vLLM 0.34.0; VLLM=0.32.0), offline models, suites and TTFT in containers, bundle
	$(call refuse,bench-strix,BENCH_ARGS TURN_REPS TURN_ARGS,the container flow takes REPS= SHARED= CHECKPOINTS= MODEL= NODES= ONE_SERVER=)
	$(ORCH) strix $(ORCH_BENCH)

# The container flow would silently ignore BENCH_ARGS; it refuses them instead.
NO_BENCH_ARGS = error: bench-cpu-image takes no BENCH_ARGS (the container flow would ignore them): it takes REPS=, SHARED=, CHECKPOINTS= and serves the Qwen3-Next tiny model only; for other bench arguments, --arch qwen3_5_moe included, run make bench-cpu BENCH_ARGS=\"...\" on the host

bench-cpu-image: setup ## the same container flow for the cpu image, on the pinned vLLM (ENGINE=buildah without Docker)
	$(if $(strip $(BENCH_ARGS)),@echo "$(NO_BENCH_ARGS)" >&2; exit 2)
	$(ORCH) cpu $(ORCH_BENCH)

test-gb10: setup-host ## the regression suite and vLLM's prefix suite inside both gb10 images (vLLM 0.34.0; VLLM=0.32.0)
	$(ORCH) gb10 --tests-only

test-strix: setup-host ## the regression suite and vLLM's prefix suite inside both strix images (vLLM 0.34.0; VLLM=0.32.0)
	$(ORCH) strix --tests-only

test-cpu: setup ## the regression suite and vLLM's prefix suite inside both cpu images
	$(ORCH) cpu --tests-only

# var VLLM: a vLLM release from pins.toml (regress, upstream-suite: unset the pinned one; gb10/strix images: unset 0.34.0; bench-cpu: unset the CPU wheel's, 0.34.0 under Triton's interpreter, others refused)
VLLM ?=

STRESS_SEEDS ?= 20

stress: setup ## many requests over one context on every checkpoint path, every chunk checked (STRESS_SEEDS= per geometry)
	@for tree in $(TREE_NAMES); do echo "== $$tree"; $(VENV_PY) -m kit.rig.stress --tree $$tree --seeds $(STRESS_SEEDS) || exit 1; done

# var RETENTION: the prefix-cache retention make regress runs its grid at (unset or dense: dense, the committed tables; 0: vllm serve's default; N: every N blocks), tables in a retention-<0|N-blocks>/ folder unless dense
RETENTION ?=

regress: setup ## geometry table on a release's stock, unpatched and patched trees, under results/regression (VLLM=<a release in pins.toml>|newest: that one, in results/regression/<release> unless it is the pinned one; RETENTION=0|N: at that retention, in a retention-<0|N-blocks>/ folder below)
	$(KIT) regress $(if $(VLLM),--vllm $(VLLM)) $(if $(RETENTION),--retention=$(RETENTION))

upstream-suite: setup ## vLLM's own tests/v1/core (and the worker tests of the modded files) on the pristine, unpatched and patched trees (VLLM=0.33.0|0.34.0|newest: a later release's)
	$(KIT) upstream-suite $(if $(VLLM),--vllm $(VLLM))

upstream-check: setup ## each change under upstream/ on pristine vLLM (its release): git apply, its new tests fail without it and pass with it, its vllm/ part equals the mod, vLLM's v1 core suite passes with it; results/upstream-check.json
	$(KIT) upstream-check

record-upstream: setup ## write the committed record of what make test checks of vLLM's suites: upstream-suite of the pinned and the newest release, then upstream-check (results/upstream-suite/, results/upstream-check.json)
	$(KIT) upstream-suite --reuse-flow
	$(KIT) upstream-suite --vllm newest
	$(KIT) upstream-check

tiny-model: setup ## write the tiny Qwen3-Next config and its seeded weights to .models/tiny-qwen3-next
	$(KIT) tiny-model --out .models/tiny-qwen3-next

build-gb10: setup-host ## build the gb10 unpatched and patched images of vLLM 0.34.0 (docker buildx; BASE_IMAGE=, ARCH=, SOURCE_BUILD=1, VLLM=0.32.0)
	$(VENV_PY) -m kit.images.build gb10 $(IMAGE_OPTS)

build-strix: setup-host ## build the strix unpatched and patched images of vLLM 0.34.0 (docker buildx; BASE_IMAGE= to override, VLLM=0.32.0)
	$(VENV_PY) -m kit.images.build strix $(IMAGE_OPTS)

build-cpu: setup ## build the cpu unpatched and patched images of the pinned vLLM (docker buildx; BASE_IMAGE= to override)
	$(VENV_PY) -m kit.images.build cpu $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(VLLM),--vllm $(VLLM))

lint-images: setup ## hadolint every Dockerfile (zero warnings; reasoned ignores only)
	.venv/bin/hadolint images/*/Dockerfile

# MODEL=<key or repo> narrows the model targets to one entry of models.lock;
# TARGET=gb10|strix to the entries a target uses; MODELS_TAR names the tarball.
# var MODEL: one models.lock entry (key or repo) for the model targets and bench-<target>
MODEL ?=
# var TARGET: the models.lock entries of one target: gb10 or strix
TARGET ?=
# var MODELS_TAR: the tarball of export-models / import-models (default models-export.tar.gz)
MODELS_TAR ?= models-export.tar.gz
# var FULL: FULL=1 makes verify-models hash every file
# var BASE_IMAGE: the base image of build-<target> and bench-<target>, instead of the pinned one
MODEL_SEL = $(if $(MODEL),--model $(MODEL)) $(if $(TARGET),--target $(TARGET))

lock-models: setup ## (online) resolve models.lock revisions to commits, record sizes and sha256
	$(KIT) models lock $(if $(MODEL),--model $(MODEL))

fetch-models: setup ## (online) download exactly the locked files into the model store
	$(KIT) models fetch $(MODEL_SEL)

verify-models: setup ## (offline) check the store against models.lock; FULL=1 hashes every file
	$(KIT) models verify $(MODEL_SEL) $(if $(FULL),--full)

export-models: setup ## (offline) write the store as $(MODELS_TAR) for an air-gapped machine
	$(KIT) models export $(MODEL_SEL) $(MODELS_TAR)

import-models: setup ## (offline) unpack $(MODELS_TAR) into the store and verify it
	$(KIT) models import $(MODEL_SEL) $(MODELS_TAR)

clean: ## remove the trees, caches and build outputs (keeps .venv and results/)
	rm -rf .trees .cache .models .pytest_cache
