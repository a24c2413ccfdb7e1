# reprotune: every stage is a make target; every target takes Hydra overrides in ARGS:
#   make train ARGS="method=qlora train.max_steps=20"
# Stage targets (prepare, train, eval, merge, gguf) run through DVC only: params.yaml is composed from
# conf/ + ARGS, then 'dvc repro <stage>' runs what is out of date up to that stage and skips the rest, so
# dvc.lock always describes outputs/ and 'make push' versions exactly what was produced. One run per checkout
# at a time; a failed or stopped stage keeps the previous outputs (docs/pipeline.md, "Failures and signals").
# REPROTUNE_DEBUG=1 shows the traceback behind any one-line error.
# Each target bootstraps .venv from the hash-locked lockfile first (idempotent; reused when current).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VARIANT ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=
# make test / test-all run one worker per core (at most 4; one more than the cores was measured slower: the fast lane
# 196 s vs 166 s on 2 cores, docs/testing-time.md). tests/conftest.py keeps each module on one worker (its own
# loadgroup scheduler: xdist's stopped grouping under pytest 9.2), hands out the longest modules first and builds
# the runs that modules share once. PYTEST_XDIST= (empty) runs in one process.
PYTEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
PYTEST_XDIST ?= -n $(PYTEST_WORKERS) --dist loadgroup
export REPROTUNE_LOCK_VARIANT := $(VARIANT)
# Runs are offline unless a model preset needs the hub; tokenizers' thread pool is off for determinism.
export TOKENIZERS_PARALLELISM := false
export HF_HUB_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1
export PYTHONHASHSEED := 0
# the project runs from this checkout's src/ (also in git worktrees that share one .venv)
export PYTHONPATH := $(CURDIR)/src

# Several processes for make train (torchrun): NPROC on this host (default: every GPU with hardware=gpu), and for
# several hosts NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (docs/gpu.md)
NPROC ?=
export NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'
	@if [ -x $(PY) ]; then echo; $(PY) -m reprotune.pipeline --stages; fi  # the stage registry, as dvc.yaml has it

.PHONY: venv
venv: ## Build or reuse .venv from lockfiles/<VARIANT>.txt (hash-checked; VARIANT=cpu or cuda)
	@VARIANT=$(VARIANT) VENV=$(VENV) bash scripts/bootstrap.sh

.PHONY: lock
lock: ## Regenerate lockfiles/ from pyproject.toml (needs uv)
	@command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet 'uv==0.13.9'
	bash scripts/lock.sh

.PHONY: data
data: venv ## Get the raw dataset: dvc pull if a remote has it, else regenerate; then verify the DVC hash
	@VENV=$(VENV) ARGS='$(subst ','\'',$(ARGS))' OWN_DATA_OK=$(if $(filter test%,$(MAKECMDGOALS)),0,1) bash scripts/get_data.sh

# Your own data, named once: conf/project/current.yaml, which every target (and dvc exp run) composes; ARGS still win
DATA ?=
NAME ?=
.PHONY: init
init: venv ## Name your data once: make init DATA=<file|folder> [NAME=...] [ARGS="model=..."] -> conf/project/current.yaml, used by every target
	$(PY) -m reprotune.project $(if $(DATA),'data.path=$(DATA)') $(if $(NAME),'data.name=$(NAME)') $(ARGS)

# ---------------------------------------------------------------------------------------------- the stages
DVC = $(VENV)/bin/dvc

# $(call stage,<name>): under the checkout's run lock, compose params.yaml, then bring <name> and everything it
# needs up to date (src/reprotune/runner.py: a second run is refused before params.yaml changes; signals reach
# the stage; a failed or stopped stage keeps the previous outputs). exec: make's own death reaches the runner.
define stage
	exec $(PY) -m reprotune.runner $(1) $(ARGS)
endef

.PHONY: prepare
prepare: data ## Validate, convert, scrub PII, split -> data/prepared/{train,holdout}.jsonl + reports (ARGS="data.path=<file|dir>")
	$(call stage,prepare)

.PHONY: plan
plan: venv ## Memory, time and cost of 'make train ARGS=...' before renting a GPU -> outputs/plan.json (no weights loaded)
	$(PY) -m reprotune.plan $(ARGS)

.PHONY: pii-review
pii-review: venv ## Print a sample of PII replacements in context, terminal only (ARGS="data.path=<file|dir>")
	$(PY) -m reprotune.pii_review $(ARGS)

.PHONY: train
train: data ## Fine-tune (LoRA/QLoRA/DoRA; NPROC=N processes via torchrun, NNODES/NODE_RANK/MASTER_ADDR for hosts) -> outputs/adapter, outputs/train/{metrics.json,loss.png,manifest.json}; ARGS="objective=dpo": DPO from it -> outputs/pref/
	$(call stage,train)

.PHONY: test
test: venv data ## The fast lane (851 tests: 2:47 on 2 idle cores): unit + fast integration tests; no llama.cpp build, no image
	$(PY) -m pytest -m "not slow" $(PYTEST_XDIST) $(PYTEST_ARGS)

.PHONY: test-all
test-all: venv data llama-cpp ## The whole suite (what .ci/run runs): + llama.cpp export, DVC pipelines, images, resumes
	$(PY) -m pytest $(PYTEST_XDIST) --durations=30 $(PYTEST_ARGS)

.PHONY: test-smoke
test-smoke: venv data ## A short train on the tiny random model (seconds)
	$(PY) -m reprotune.prepare $(ARGS)
	$(PY) -m reprotune.train model=tiny_random train.max_steps=4 train.save_steps=2 $(ARGS)

.PHONY: lint
lint: venv ## ruff
	$(VENV)/bin/ruff check src tests scripts bench

.PHONY: clean
clean: ## Remove outputs/ and prepared data (keeps .venv, the model cache and raw data)
	rm -rf outputs data/prepared

.PHONY: eval
eval: data ## Base vs fine-tuned (vs eval.baseline.url) on the holdout -> outputs/eval/{report.md,metrics.json,comparison.png,predictions.jsonl}; ARGS="objective=dpo": outputs/pref/eval
	$(call stage,eval)

# ---------------------------------------------------------------------------------------- reproducibility
RUN ?=

.PHONY: dvc-yaml
dvc-yaml: venv ## Regenerate dvc.yaml from the code (deps = imported modules, params = config keys read)
	$(PY) -m reprotune.pipeline

.PHONY: params
params: venv ## Compose conf/ (+ ARGS overrides) into params.yaml, the config DVC tracks
	$(PY) -m reprotune.config $(ARGS)

.PHONY: repro
repro: data ## The whole pipeline through DVC: params.yaml from ARGS, then dvc repro (skips what is up to date)
	$(call stage,all)

.PHONY: all
all: repro ## Same as make repro

.PHONY: push
push: venv ## Upload data and outputs (adapters, manifests) to the default DVC remote (dvc push)
	$(DVC) push $(ARGS)

.PHONY: pull
pull: venv ## Download data and outputs of the checked-out revision from the DVC remote (dvc pull)
	$(DVC) pull $(ARGS)

.PHONY: verify
verify: venv ## Re-run a recorded run in a temp dir and compare bytes: RUN=<manifest.json or git rev>
	@test -n "$(RUN)" || { echo "usage: make verify RUN=outputs/train/manifest.json (or a git revision)" >&2; exit 2; }
	$(PY) -m reprotune.verify $(RUN) $(ARGS)

# ---- Containers: the pinned image (docker/Dockerfile) and RUNNER=docker ------------------------------------------
#   make docker-build VARIANT=cpu|cuda          build reprotune:<variant> (docs/containers.md)
#   make train RUNNER=docker ARGS="..."         any target: every recipe line runs inside the image
RUNNER ?= local
DOCKER ?= docker
REPROTUNE_IMAGE ?= reprotune:$(VARIANT)

.PHONY: docker-build
docker-build: ## Build the image reprotune:<VARIANT> from docker/Dockerfile (LLAMA_CPP=0 skips llama.cpp's tools)
	@VARIANT=$(VARIANT) DOCKER=$(DOCKER) REPROTUNE_IMAGE=$(REPROTUNE_IMAGE) bash scripts/docker_build.sh

.PHONY: docker-test
docker-test: venv ## The image checks alone: hadolint, digest pins, build, smoke run (--network=none), rebuild identity
	$(PY) -m pytest tests/test_docker.py $(PYTEST_ARGS)

ifeq ($(RUNNER),docker)
ifneq ($(REPROTUNE_IN_CONTAINER),1)
# make decides what is out of date here; scripts/docker_shell.sh runs each recipe line in the image, with this
# checkout at /workspace and the image's locked environment (its stamp is current, so 'venv' rebuilds nothing).
VARIANT := $(VARIANT)
VENV := /opt/venv
PY := $(VENV)/bin/python
PYTHONPATH := /workspace/src
export DOCKER_VARIANT := $(VARIANT)
export REPROTUNE_IMAGE DOCKER
SHELL := $(CURDIR)/scripts/docker_shell.sh
help docker-build: SHELL := /bin/bash
endif
else ifneq ($(RUNNER),local)
$(error RUNNER=$(RUNNER): use RUNNER=local (the default) or RUNNER=docker)
endif

# ---- export and serving (merge -> gguf -> serve); see docs/export.md
.PHONY: llama-cpp
llama-cpp: venv ## Build (once, cached in .cache/llama-cpp) and install the hash-pinned llama.cpp
	@bash scripts/build_llama_cpp.sh >/dev/null

.PHONY: merge
merge: data ## Merge the adapter into the full-precision base -> outputs/merged/ (+ parity.json); ARGS="objective=dpo": the preference adapter -> outputs/pref/merged/
	$(call stage,merge)

.PHONY: gguf
gguf: data llama-cpp ## Convert outputs/merged to GGUF, quantize (export.quant), check parity, write the Modelfile; ARGS="objective=dpo": outputs/pref/merged -> outputs/pref/gguf/
	$(call stage,gguf)

.PHONY: serve
serve: gguf ## OpenAI-compatible server on the GGUF (llama.cpp), on 127.0.0.1:8080 by default; ARGS="objective=dpo": outputs/pref/gguf
	$(PY) -m reprotune.serve $(ARGS)

.PHONY: serve-info
serve-info: venv ## Print the llama.cpp, vLLM (base + adapter) and Ollama serving commands
	@$(PY) -m reprotune.serve export.serve.info_only=true $(ARGS)

.PHONY: publish
publish: venv ## Opt-in: push adapter/merged to the HF Hub (dry run unless export.publish.push=true; never private data)
	$(PY) -m reprotune.publish $(ARGS)
