# parallel_lab: the two README commands are `make app` and `make test`; both build .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# On this machine torch's CPU build lies on disk and `pip install torch==2.13.0` takes it in seconds.
# GPU users: `make test TORCH_SPEC="torch>=2.4"` (or pre-install torch into .venv) keeps their CUDA build.
TORCH_SPEC ?= torch==2.13.0
PORT ?= $(shell $(PYTHON) -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
STAMP  := $(VENV)/.installed
# `make test` also installs the titan extra (torchtitan + triton, ~0.4 GB: tests/test_torchtitan.py); `make app`,
# `make lab`, `make docs` do not.
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install test app lab docs bench gpu-check lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[dev,docs]"
	@$(BIN)/python -c "import matplotlib.pyplot"   # build the font cache once, not on the first page view
	@touch $(STAMP)

# torch is already in .venv, so pip keeps it (torchtitan asks torch>=2.11; a CPU 2.13 satisfies it)
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e ".[dev,docs,titan]"
	@$(BIN)/python -c "import torch, torchtitan.train; print('torchtitan with torch', torch.__version__)"
	@touch $(TEST_STAMP)

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

app: $(STAMP)
	@# Voila on 127.0.0.1 (Host-checked, one kernel per page session, a kernel cap), code hidden, offline
	@# template, idle kernels culled; the URL is printed once the server answers: see parallel_lab/viz/serve.py
	@$(BIN)/python -m parallel_lab.viz.serve --port=$(PORT)

# Jupyter refuses to start as root unless told; in a container root is the usual user, so tell it there.
ALLOW_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

# The app links the lessons to this port (parallel_lab/viz/explorers/lessons.py LAB_PORT); no silent move.
LAB_PORT ?= 8888
# The URL it prints opens the first lesson (the file browser shows the others).
FIRST_LESSON ?= 00_collectives
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks --no-browser --ServerApp.ip=127.0.0.1 --port=$(LAB_PORT) \
		--ServerApp.port_retries=0 --LabApp.default_url=/lab/tree/$(FIRST_LESSON).ipynb $(ALLOW_ROOT)

# The course as a static site in site/ (mkdocs.yml): the lessons executed, every page offline; open
# site/index.html. tests/test_docs_site.py builds it too and checks its links.
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python -m bench

# On a machine with NVIDIA GPUs: the ledger, the activation models and NCCL against CUDA (bench/gpu_check.py);
# without one it says so and exits 0.
gpu-check: $(STAMP)
	$(BIN)/python -m bench.gpu_check

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .ruff_cache
