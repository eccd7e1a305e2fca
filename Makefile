# Two entry points (see README): `make demo` and `make test`. Both create .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO   ?= demo-out
# torch==2.13.0 is the CPU build these machines carry locally; any other spec downloads CUDA wheels.
TORCH  := torch==2.13.0

.PHONY: demo test test-fast lint bench completions clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.base: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base tests/writers/frameworks-nodeps.txt
	$(BIN)/python -m pip install -q $(TORCH) -e '.[dev,s3]'
	$(BIN)/python -m pip install -q --no-deps -r tests/writers/frameworks-nodeps.txt
	touch $@

demo: $(VENV)/.base
	$(BIN)/ckptctl demo $(DEMO) --force
	$(BIN)/ckptctl list $(DEMO)
	$(BIN)/ckptctl verify $(DEMO)
	$(BIN)/ckptctl inspect $(DEMO)/native/step-30 --limit 12
	$(BIN)/ckptctl inspect $(DEMO)/dcp/step-30 --limit 12
	$(BIN)/ckptctl report $(DEMO) -o $(DEMO)/report.html

# Two workers share each slow writer's output (tests/conftest.py: build_once), so the suite is not slower on
# 2 cores than one process, and faster on more; TESTFLAGS adds pytest options (TESTFLAGS="-k prune").
WORKERS ?= 2
test: $(VENV)/.dev
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup $(TESTFLAGS)

# The inner loop: no multi-process writers, no large state (tests marked or inferred `slow`).
test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -q -m "not slow" $(TESTFLAGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check ckptctl tests bench scripts
	$(BIN)/ruff format --check ckptctl tests bench scripts
	$(BIN)/mypy
	$(BIN)/python -m scripts.check_imports

# Every bench in bench/ at a size that finishes in about 10 minutes on 2 cores, then one table of ratios
# (ours / floor, ours / best peer) of the verify, diff and save benches (bench/summary.py: BENCHES).
# bench/sync.py's peers: `aws` (pip awscli, in a venv of its own: its botocore pin is not s3fs's) and `rclone`
# (the Debian package, where apt-get can install it; without it the sync bench compares with aws alone).
PEERS  := .venv-peers
bench: $(VENV)/.dev
	$(BIN)/python -m pip install -q --no-deps -r bench/peers-nodeps.txt
	test -x $(PEERS)/bin/aws || ($(PYTHON) -m venv $(PEERS) && $(PEERS)/bin/python -m pip install -q awscli)
	command -v rclone >/dev/null || apt-get install -y -q rclone >/dev/null 2>&1 || echo "rclone not installed" >&2
	PATH="$$PATH:$(abspath $(PEERS))/bin" $(BIN)/python bench/summary.py

# Shell completions (completions/) and the command reference (docs/cli.md), both generated from the CLI.
completions: $(VENV)/.base
	$(BIN)/python scripts/gen_completions.py
	$(BIN)/python -m scripts.gen_cli_reference

clean:
	rm -rf $(VENV) $(PEERS) $(DEMO) .pytest_cache .mypy_cache .ruff_cache
