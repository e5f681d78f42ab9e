# `make serve` and `make test` do all the set-up on a fresh clone: a virtual
# environment in .venv with the pinned torch from pip's indexes (PyPI's Linux wheel is
# the CUDA 13.0 build; PIP_TORCH_ARGS=--index-url=https://download.pytorch.org/whl/cpu
# for the CPU build, .../whl/cu128 for another CUDA's, after `make clean` where .venv
# exists: it is made once, and keeps the torch it holds).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
# the versions the test suite runs on (CONSTRAINTS=/dev/null: the newest pyproject allows)
CONSTRAINTS ?= constraints.txt
# the extras installed with rawserve (the Dockerfile installs "onnx,image")
EXTRAS ?= test,dev,onnx
ARGS ?=
# `make test` runs the suite in this many processes, a test file each at a time
# (pytest-xdist): its end-to-end files wait on servers about as long as they compute,
# and the suite took 20 minutes in one process on 2 cores, 14.5 in two. 0: in one.
TEST_PROCESSES ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help serve test test-deps lint bench bench-http bench-generation bench-generation-overload bench-gpu reference-answers clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" --constraint $(CONSTRAINTS)
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m rawserve $(ARGS)

test: $(STAMP) test-deps
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile $(ARGS)

# nginx for tests/test_nginx.py (the Debian package), when missing and we are root;
# without it those tests are skipped, with a message saying so.
test-deps:
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq || true; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null || \
	      echo "could not install nginx: tests/test_nginx.py will be skipped"; \
	  else echo "nginx is missing (install it as root): tests/test_nginx.py will be skipped"; fi; }

# ruff (lint and format) and the type checker, mypy (its settings: pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check rawserve tests bench scripts
	$(VENV)/bin/ruff format --check rawserve tests bench scripts
	$(VENV)/bin/mypy

# rawserve against the model's own ceiling and the seed's Starlette server, side by side
# (bench/RESULTS.md), then bench-http and bench-generation: about 9 + 4 + 15 minutes on
# 2 cores, loopback only. ARGS go to bench.compare: ARGS="--record" rewrites the Performance
# section of bench/RESULTS.md; ARGS="--quick" is a short try, of the other two steps as well.
QUICK_HTTP := --rounds 1 --duration 2
QUICK_GENERATION := --rounds 1 --scenarios "16 x 64"
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	HF_HUB_OFFLINE=1 $(PY) -m bench.compare $(ARGS)
	$(MAKE) bench-http ARGS='$(if $(filter --quick,$(ARGS)),$(QUICK_HTTP))'
	$(MAKE) bench-generation ARGS='$(if $(filter --quick,$(ARGS)),$(QUICK_GENERATION))'

# the server's own ceiling (echo handler) at 1, 2, 4 ... HTTP processes, asyncio and uvloop,
# interleaved (bench/RESULTS.md, "HTTP across processes"): about 4 minutes on 2 cores
bench-http: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m bench.http_processes $(ARGS)

# served generation (bench/RESULTS.md, "Served generation"): rawserve's continuous and static
# generation over /v1/completions against in-process static batching of the same prompts,
# 3 interleaved rounds; about 15 minutes on 2 cores. `transformers serve --continuous-batching`
# runs beside them (the bench extra installs transformers' serving extra and accelerate);
# on a GPU, ARGS="--device cuda --layers 12 --hidden 768".
bench-generation: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	HF_HUB_OFFLINE=1 $(PY) -m bench.generation_serving $(ARGS)

# served generation past its capacity (bench/generation_overload.py): capacity, then 3x it
# with 5 s deadlines; goodput, 503s and 504s, 3 rounds, about 6 minutes on 2 cores
bench-generation-overload: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m bench.generation_overload $(ARGS)

# every GPU measurement in one pass bounded in time (bench/gpu_round.py): the issues' open
# targets first (HTTP processes, encoders and their overload, generation and its overload),
# then the rest as the budget (500 s) allows; the logs and summary.json in bench-gpu/
# (ARGS="--stages others" for the rest, ARGS="--dry-run" for every stage on the CPU, tiny).
# On a lent GPU machine: scripts/gpu_wheels.sh here, then gpu-wheels/round.sh there
# (bench/RESULTS.md, "Measuring on a lent GPU").
bench-gpu: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	HF_HUB_OFFLINE=1 $(PY) -m bench.gpu_round --out bench-gpu $(ARGS)

# transformers 4's answers for tests/test_fidelity.py, into tests/fidelity_reference.json.
# The first run makes .venv-transformers4 (transformers 4.57.6 and the same torch); it prints
# how long it took. Not part of `make test`: the tests read the committed answers.
reference-answers: $(STAMP)
	TORCH_SPEC="$(TORCH_SPEC)" PIP_TORCH_ARGS="$(PIP_TORCH_ARGS)" HF_HUB_OFFLINE=1 \
	  $(PY) scripts/transformers4_reference.py

clean:
	rm -rf $(VENV) .venv-transformers4

help:
	@echo "make                  create .venv: rawserve, torch ($(TORCH_SPEC)), the versions of $(CONSTRAINTS)"
	@echo "make serve ARGS=...   serve (no ARGS: the packaged all-MiniLM-L6-v2 on 127.0.0.1:8000)"
	@echo "make test ARGS=...    run the test suite (ARGS: pytest's, e.g. tests/test_tei.py)"
	@echo "make lint             ruff and mypy"
	@echo "make bench            rawserve against the model's ceiling and other servers (~30 min)"
	@echo "make bench-http       the server's own ceiling across HTTP processes"
	@echo "make bench-generation served generation against static batching"
	@echo "make bench-generation-overload   generation past its capacity"
	@echo "make bench-gpu        every GPU measurement in one pass (on a GPU machine)"
	@echo "make reference-answers   transformers 4's answers for tests/test_fidelity.py"
	@echo "make clean            remove .venv (then PIP_TORCH_ARGS=... picks another torch)"
