# Set-up on a fresh machine: `make demo` or `make test`. Both create .venv on their own.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned for the test venv only (a local CPU wheel); the package itself asks for torch>=2.4.
TORCH_PIN ?= torch==2.13.0

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

.PHONY: install demo test clean
install: $(VENV)/.installed

demo: install
	$(BIN)/memlens estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision amp-bf16

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
