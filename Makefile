# Two commands on a fresh machine:  make run   (the job on hosts.yaml)   and   make test
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
HOSTS ?= hosts.yaml
# The supported torch range (pyproject.toml, agent/compat.py) is tested at three points: the main
# venv has the newest, $(BASE_VENV) the torch of the Dockerfile's default base, $(OLDEST_VENV) the
# oldest. `make test` runs the trainer's end-to-end tests on all three and a cluster run on both ends.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
BASE_VENV ?= .venv-torch-base
BASE_TORCH_PINS ?= torch==2.9.0 torchvision==0.24.0
OLDEST_VENV ?= .venv-torch-oldest
OLDEST_TORCH_PINS ?= torch==2.5.1 torchvision==0.20.1
# The interpreters of the other two points, for the tests (tests/torch_ends.py).
TORCH_POINTS = DDP_TORCH_BASE_PYTHON=$(abspath $(BASE_VENV))/bin/python DDP_TORCH_OLDEST_PYTHON=$(abspath $(OLDEST_VENV))/bin/python
DEPLOY := $(VENV)/bin/ddp-deploy --hosts $(HOSTS)
PYTEST_ARGS ?=
LANES ?= 3

.PHONY: install install-base install-oldest operator-wheels tools gpu-check run check deploy sync launch wait status logs stop unlock run-local image test test-serial test-fast test-area clean

# A venv with torch's pins and this package (editable) with its test tools: tools/venv.sh, which
# copies what it can from a venv kept by the hash of its inputs (DDP_VENV_CACHE= to build afresh).
$(VENV)/.installed: pyproject.toml tools/venv.sh
	PYTHON=$(PYTHON) bash tools/venv.sh $(VENV) $(TORCH_PINS)

install: $(VENV)/.installed

$(BASE_VENV)/.installed: pyproject.toml tools/venv.sh
	PYTHON=$(PYTHON) bash tools/venv.sh $(BASE_VENV) $(BASE_TORCH_PINS)

install-base: $(BASE_VENV)/.installed

$(OLDEST_VENV)/.installed: pyproject.toml tools/venv.sh
	PYTHON=$(PYTHON) bash tools/venv.sh $(OLDEST_VENV) $(OLDEST_TORCH_PINS)

install-oldest: $(OLDEST_VENV)/.installed

# The wheels of the operator's install (ddp-deploy without torch: pyproject.toml's dependencies),
# fetched here so that tests/test_operator_install.py installs them into a fresh venv offline.
OPERATOR_WHEELS ?= .wheels-operator
$(OPERATOR_WHEELS)/.done: pyproject.toml $(VENV)/.installed
	rm -rf $(OPERATOR_WHEELS)
	$(VENV)/bin/pip download -q -d $(OPERATOR_WHEELS) . setuptools wheel
	touch $@

operator-wheels: $(OPERATOR_WHEELS)/.done

## What the tests need, the three venvs made side by side (unpacking and compiling torch takes a core each).
tools:
	$(MAKE) -j4 install install-base install-oldest operator-wheels

## The main job on the shipped hosts.yaml (this machine alone): check, deploy, launch, wait, status.
run: install
	$(DEPLOY) check
	$(DEPLOY) deploy
	$(DEPLOY) launch --wait
	$(DEPLOY) status

check: install
	$(DEPLOY) check

deploy sync: install
	$(DEPLOY) deploy

launch: install
	$(DEPLOY) launch

wait: install
	$(DEPLOY) launch --wait

status: install
	$(DEPLOY) status

logs: install
	$(DEPLOY) logs

stop: install
	$(DEPLOY) stop

unlock: install
	$(DEPLOY) unlock

## The trainer alone on this machine, no deploy tool: torchrun standalone, 2 processes.
run-local: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 -m trainer --data-dir runs/data --ckpt-dir runs/ckpt $(ARGS)

## The GPU acceptance check, on a machine with NVIDIA GPUs (no Docker): exits 2 where none is visible.
gpu-check: install
	$(VENV)/bin/python bench/gpu_check.py $(ARGS)

## The image (BASE_IMAGE=... to build on another base).
image:
	docker build $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t ddp-trainer:latest .

## Every test, in three workers side by side (pytest-xdist, tools/suite/lanes.py): the cluster tests in two
## lanes, each on a cluster of its own, in order; every other test, reniced, in whichever worker is
## free. CI runs this. LANES=2: the cluster tests in one lane on one cluster (docs/testing.md).
test: tools
	$(TORCH_POINTS) $(VENV)/bin/python -m pytest -ra -n $(LANES) $(PYTEST_ARGS)

## The same tests in one process, one after the other.
test-serial: tools
	$(TORCH_POINTS) $(VENV)/bin/python -m pytest -ra $(PYTEST_ARGS)

test-fast: install
	$(VENV)/bin/python -m pytest -ra -m "not e2e and not cluster" $(PYTEST_ARGS)

## The quick loop while changing one area: the test files whose names hold AREA, the cluster's too
## (make test-area AREA=chain); the base's and the oldest torch run where installed, else are skipped.
AREA_TESTS = $(wildcard tests/test_*$(AREA)*.py tests/cluster/test_*$(AREA)*.py)
test-area: install
	$(if $(AREA),,$(error name the area: make test-area AREA=chain (the test files whose names hold it)))
	$(if $(AREA_TESTS),,$(error no test file's name holds '$(AREA)': ls tests/test_*.py tests/cluster/test_*.py))
	$(if $(wildcard $(BASE_VENV)/bin/python),DDP_TORCH_BASE_PYTHON=$(abspath $(BASE_VENV))/bin/python) \
	$(if $(wildcard $(OLDEST_VENV)/bin/python),DDP_TORCH_OLDEST_PYTHON=$(abspath $(OLDEST_VENV))/bin/python) \
	    $(VENV)/bin/python -m pytest -ra $(AREA_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
