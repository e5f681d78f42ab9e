# `make serve` and `make test` do all the set-up on a fresh clone: a virtual
# environment in .venv with the pinned CPU build of torch (override TORCH_SPEC for
# a CUDA build, e.g. `make serve TORCH_SPEC=torch==2.13.0 PIP_TORCH_ARGS=--index-url=...`).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,dev]"
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m rawserve $(ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check rawserve tests bench
	$(VENV)/bin/ruff format --check rawserve tests bench

clean:
	rm -rf $(VENV)
