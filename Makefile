# Two commands on a fresh machine:  make run   (the job on hosts.yaml)   and   make test
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
HOSTS ?= hosts.yaml
# torch/torchvision pins that install from the files on these machines (see README); override freely.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
DEPLOY := $(VENV)/bin/ddp-deploy --hosts $(HOSTS)
PYTEST_ARGS ?=

.PHONY: install run check deploy sync launch wait status logs stop run-local image test test-fast clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH_PINS)
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

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

## The trainer alone on this machine, no deploy tool: torchrun standalone, 2 processes.
run-local: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 -m trainer --data-dir runs/data --ckpt-dir runs/ckpt $(ARGS)

## The image (BASE_IMAGE=... to build on another base).
image:
	docker build $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t ddp-trainer:latest .

test: install
	$(VENV)/bin/python -m pytest -ra $(PYTEST_ARGS)

test-fast: install
	$(VENV)/bin/python -m pytest -ra -m "not e2e and not cluster" $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
