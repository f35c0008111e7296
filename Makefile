# Set-up on a fresh machine: `make demo` or `make test`. Both create .venv on their own.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned for the test venvs only (a local CPU wheel); the package itself asks for torch>=2.11,<3.
TORCH_PIN ?= torch==2.13.0
# The lowest supported versions (pyproject's lower bounds; memlens/core/version.py TESTED): the core suite runs on
# them too, in a second venv, so that pyproject's ranges stay true.
LOWEST_PINS ?= transformers==5.15.0 peft==0.18.0 opacus==1.6.0
LOWEST := .venv-lowest
# The core suite: what the installed transformers / peft / opacus change: the spec, the ledger, estimate on small
# models, every spec field, the step kinds (peft, Opacus, TRL), the architectures, the estimate command. The rest of the
# CLI (its contract, the fuzz, interrupts, budgets) reads memlens' own code only: it runs once, on the newest versions.
# Its tests marked slow run once too, on the newest versions (CORE_ARGS): memlens' own searches over steps the core
# suite simulates here already (fit and compare over the TRL steps and a UNet, a VLM's largest micro-batch as fit
# probes it, EMA's layers written from shallow models), Opacus trials measured in subprocesses (opacus is 1.6.0 in
# both venvs) and the simulations of whole UNet/DiT families (diffusers is one release in both; their batches, LoRA
# through peft, EMA and refusals still run here). Every step kind, architecture and spec field runs on the lowest
# transformers and peft.
CORE_TESTS ?= tests/test_spec.py tests/test_ledger.py tests/test_versions.py tests/estimator/test_simulate.py \
	tests/cli/test_estimate_cli.py tests/step tests/models
CORE_ARGS ?= -m "not slow"

# pip --no-compile: no byte-compiling of every installed module (torch, transformers, sympy, ... : thousands of files
# the tests never import); Python compiles what is imported, once, on first import, and writes it beside the source.
# It writes nothing where the environment sets PYTHONDONTWRITEBYTECODE (containers and CI images often do): then
# every process of the suite (each xdist worker, each subprocess and torchrun rank) compiles torch and transformers
# again, about 5 CPU-s each: the recipes here run without it. After an install, one import of what the suite imports
# compiles it once (else both workers compile the same files at the same time): the test modules' imports, and what
# torch, trl and lightning import on first use (torch._dynamo, datasets, pandas, torchmetrics: ~2,300 files that a
# fresh clone's suite compiled in its workers before).
PIP_INSTALL := pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
WARM_IMPORTS := import torch, transformers, peft, opacus, accelerate, hypothesis, pytest, xdist, memlens.cli.main, memlens.estimator, \
	torch._dynamo, lightning, diffusers, trl, matplotlib.pyplot

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The newest releases pyproject's ranges allow, as a fresh `pip install` gets them (eager: an existing .venv is
# upgraded too when pyproject changes), torch held at the pin.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/$(PIP_INSTALL) $(TORCH_PIN)
	$(BIN)/$(PIP_INSTALL) --upgrade --upgrade-strategy eager -e ".[dev]" $(TORCH_PIN)
	$(BIN)/python -c "$(WARM_IMPORTS)"
	touch $@

$(LOWEST)/bin/python:
	$(PY) -m venv $(LOWEST)
	$(LOWEST)/bin/pip install -q --upgrade pip

$(LOWEST)/.installed: $(LOWEST)/bin/python pyproject.toml Makefile
	$(LOWEST)/bin/$(PIP_INSTALL) $(TORCH_PIN)
	$(LOWEST)/bin/$(PIP_INSTALL) -e ".[dev]" $(LOWEST_PINS)
	$(LOWEST)/bin/python -c "$(WARM_IMPORTS)"
	touch $@

.PHONY: install install-lowest demo test test-main test-lowest clean
install: $(VENV)/.installed
install-lowest: $(LOWEST)/.installed

demo: install
	$(BIN)/memlens estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision amp-bf16

# pytest-xdist workers (`-n`): auto is one per core, at most 8 (each holds torch, transformers and a model: about
# 1 GiB). Tests run in any order and any worker (tmp_path, no fixed files or ports); `PYTEST_N=0 make test` runs in
# one process, `PYTEST_ARGS="-m 'not slow'"` skips the slow ones.
PYTEST_N ?= auto
XDIST := -n $(PYTEST_N) --maxprocesses 8
PYTEST_ARGS ?=

# The whole suite on the newest versions, then the core suite on the lowest ones. The two venvs are installed side
# by side first (pip is mostly unpacking wheels: one core each), then the suites run one after the other (each
# already uses every core).
test:
	$(MAKE) -j2 install install-lowest
	$(MAKE) test-main
	$(MAKE) test-lowest

test-main: install
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-lowest: install-lowest
	$(LOWEST)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) $(CORE_ARGS) $(PYTEST_ARGS) $(CORE_TESTS)

clean:
	rm -rf $(VENV) $(LOWEST) .pytest_cache
