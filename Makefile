# Quick start: `make train` (the embedded default job) and `make test` (the suite).
# Both create or reuse .venv at the repo root with the pinned CPU dependencies.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 2
ARGS ?=
# pytest-xdist workers; one test file stays on one worker (its module-scoped process groups are built once).
TEST_WORKERS ?= 2

# The coding harnesses the endpoint is tested against (docs/agents.md, "Coding harnesses"), pinned to the versions
# of its conformance table, from the npm registry into .harnesses/.
HARNESSES := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 @qwen-code/qwen-code@0.15.10 opencode-ai@1.18.33
HARNESS_STAMP := .harnesses/.installed-$(shell echo "$(HARNESSES)" | cksum | cut -d' ' -f1)

.PHONY: venv train test lint bench clean harnesses

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,cpu]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

train: venv
	OMP_NUM_THREADS=1 $(PY) launch/pretrain_rl.py --nproc_per_node $(NPROC) $(ARGS)

test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

harnesses: $(HARNESS_STAMP)

$(HARNESS_STAMP):
	npm install --silent --no-audit --no-fund --prefix .harnesses $(HARNESSES)
	touch $(HARNESS_STAMP)

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf outputs .pytest_cache
