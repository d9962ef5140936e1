# Two commands set everything up on a fresh machine: `make run` and `make test`.
# For contributors: `make check` (lint, format, types; seconds) and `make unit` (the tests that
# need no external binary: no Jaeger or kubeconform build).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

NATIVE := build/native/manifest.json

.PHONY: run check unit test install bench clean jaeger kubeconform native node-sdk

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP) $(DEMO_STAMP)

# What the demo needs (the proxy, the twins, the openai SDK for the README's example, mypyc for
# `make native`): the test extra's validators and schemas are hundreds of MB more.
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[demo]'
	touch $(DEMO_STAMP)

install: $(STAMP)

# The decision path compiled with mypyc (less than half the time per decision; fleet/native.py
# runs it only while every source of fleet/ and policies/ is as compiled, else the sources).
# Needs a C compiler and Python's headers; deploy/native.py says so first when they lack.
$(NATIVE): $(DEMO_STAMP) $(wildcard fleet/*.py policies/*.py) deploy/native.py
	$(BIN)/python deploy/native.py

native: $(NATIVE)

# The demo: a spec twin, a base twin and the proxy on 127.0.0.1:8000 (compiled when it can be).
run: $(DEMO_STAMP)
	$(MAKE) native || echo "make native failed: the proxy runs the decision path from source"
	$(BIN)/specroute demo

# Jaeger v2 built from source once into ~/.cache/specroute (the trace tests query a real one).
jaeger:
	bash tests/support/build_jaeger.sh >/dev/null

# kubeconform (tests/deploy's Kubernetes manifest validator) built once into ~/.cache/specroute.
kubeconform:
	bash tests/deploy/build_kubeconform.sh >/dev/null

# The openai Node SDK pinned in tests/proxy/node_sdk/package-lock.json (`npm ci`, once per lock),
# which tests/proxy/test_node_sdk.py drives the proxy with.
node-sdk:
	bash tests/support/install_node_sdk.sh

# ruff (lint, then the formatter in check mode) and mypy, configured in pyproject.toml.
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The tests that run no external binary (tests/conftest.py marks the others `external`).
unit: $(STAMP)
	$(BIN)/python -m pytest -m "not external"

# Every test twice: from source, then with the decision path compiled (as `make run` serves it).
test: check jaeger kubeconform node-sdk
	rm -rf build/native
	$(BIN)/python -m pytest
	$(BIN)/python deploy/native.py
	$(BIN)/python deploy/native.py --status --require
	$(BIN)/python -m pytest

# Every benchmark whose figures docs/ records (long); `python -m bench` lists them.
bench: $(STAMP)
	$(BIN)/python -m bench all

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
