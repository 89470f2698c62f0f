# Two commands set up a fresh machine: `make serve` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
# Test workers (pytest-xdist). Each test file runs on one worker: module fixtures start once; files
# marked slow_file go first (tests/conftest.py), in the order collected.
PYTEST_WORKERS ?= 2
# Where pip finds no CPU torch wheel of its own (a plain PyPI setup gets the multi-GB CUDA build), name
# the CPU index: make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
BIN := $(VENV)/bin
# uv installs in parallel (torch alone: ~4 s against pip's ~35 s). It reads no pip.conf, so it is handed
# the wheel folders and indexes pip is configured with (a machine's local mirror stays in use; computed
# once, when an install runs), and it takes the best version from every index, as pip does (uv's default
# stops at the first index that has the package at all). It compiles no bytecode (all of torch: ~20 s on
# two cores); each module's is written when a process first imports it. So this file's commands write
# bytecode even where PYTHONDONTWRITEBYTECODE is set: there every process would compile torch again.
unexport PYTHONDONTWRITEBYTECODE
UV_SOURCES = $(eval UV_SOURCES := $(shell $(PYTHON) -m pip config list 2>/dev/null \
	| sed -n "s/^[a-z]*\.\(find-links\|index-url\|extra-index-url\)='\(.*\)'$$/\1 \2/p" \
	| awk '{for (i = 2; i <= NF; i++) printf "--%s %s ", $$1, $$i}'))$(UV_SOURCES)
UV := uv==0.13.9
UV_INSTALL = $(BIN)/uv pip install -q --index-strategy unsafe-best-match --python $(BIN)/python \
	$(UV_SOURCES)
# mypy's cache outside the checkout: a new clone on the same machine checks in seconds, not a minute
# (entries are validated by each file's hash, so a stale one is never trusted).
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/hybridserve/mypy
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-deps-stamp

.PHONY: install serve generate test lint unit docs clean

$(STAMP): pyproject.toml
	# The venv gets uv from this Python's pip (no copy of pip to unpack first: ~4 s), else from its own.
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install -q $(UV) \
		|| ($(BIN)/python -m ensurepip > /dev/null && $(BIN)/python -m pip install -q $(UV))
	$(UV_INSTALL) pip
	# CPU torch first: an open torch requirement would pull a multi-GB CUDA build.
	$(UV_INSTALL) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	# Serving needs only the runtime dependencies; `make test` adds the test extras.
	$(UV_INSTALL) -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(UV_INSTALL) -e '.[test]'
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

serve: $(STAMP)
	$(BIN)/hybridserve serve $(ARGS)

generate: $(STAMP)
	$(BIN)/hybridserve generate $(ARGS) "It is a truth universally acknowledged"

lint: $(TEST_STAMP)
	$(BIN)/ruff check hybridserve tests benchmarks
	$(BIN)/mypy --cache-dir $(MYPY_CACHE) hybridserve

unit: $(TEST_STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test: lint unit

# docs/flags.md from the flags' help text (tests/test_flag_reference.py checks it is current).
docs: $(STAMP)
	$(BIN)/python -m hybridserve.flag_reference > docs/flags.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
