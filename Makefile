# Two commands: `make test` and `make demo`. Both bootstrap .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test demo bench docs lint typecheck pure-leg unit integration nats-server nats-js nats-core prometheus tmux clean

# Where PYTHONDONTWRITEBYTECODE is set (many containers and CI images set it) no process
# keeps the bytecode it compiles: each of the ~1,000 brokers and commands the tests start
# compiled meshbus again (a broker's start took 0.59 s of CPU instead of 0.28 s), and
# each pytest worker its ~250 test modules (10.6 s of CPU to collect instead of 3.8 s).
# What make runs keeps it, in the __pycache__ folders git ignores.
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The dependencies and the package, without its compiled part (built next, below).
$(STAMP): $(BIN)/python pyproject.toml setup.py
	MESHBUS_DEFER_BUILD=1 $(BIN)/python -m pip install --quiet -e '.[test,spark]'
	touch $(STAMP)

# The compiled hot path (setup.py, src/meshbus/compiled.py): built here, beside the checks
# (make test runs them side by side), when it is missing or a module it compiles is newer
# than its extension (the source runs then). Where it cannot be built (no C compiler), the
# pure-Python source runs; this says which.
COMPILED := $(VENV)/.compiled
$(COMPILED): $(STAMP) $(wildcard src/meshbus/protocol/*.py src/meshbus/client/*.py)
	@$(BIN)/python -c 'import sys, meshbus.compiled as c; sys.exit(c.available({}) is not c.Leg.COMPILED)' \
	  || $(BIN)/python -m pip install --quiet --no-deps -e .
	@$(BIN)/python -c 'import meshbus.compiled as c; print("meshbus hot path:", c.select().value)'
	@touch $(COMPILED)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples setup.py docs/*.py
	$(BIN)/ruff format --check src tests bench examples setup.py docs/*.py
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# The benchmark tests compare against nats-server, a Debian package.
nats-server:
	@command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || { \
	  echo "installing the nats-server Debian package (the benchmark's peer)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null \
	  || { echo "could not install nats-server: run 'apt-get install nats-server' as root"; exit 1; }; }

# The nats.js tests (tests/integration/test_nats_js.py) run the NATS project's Node.js
# client, pinned in tests/nats_js/package-lock.json, on Node.js (Debian's nodejs and npm).
nats-js:
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || { \
	  echo "installing the nodejs and npm Debian packages (the nats.js tests' runtime)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null \
	  || { echo "could not install nodejs: run 'apt-get install nodejs npm' as root"; exit 1; }; }
	@[ tests/nats_js/node_modules/.package-lock.json -nt tests/nats_js/package-lock.json ] || \
	  npm ci --prefix tests/nats_js --no-audit --no-fund --silent

# The nats-core tests (tests/integration/test_nats_core.py) run the NATS project's new
# Python client, which needs Python >= 3.13: where one is found (python3.13 on PATH, or
# installed by pyenv), in a venv of its own, tests/nats_core/.venv, made once from the pins
# in tests/nats_core/requirements.txt; where none is, those tests skip.
nats-core:
	@$(PYTHON) -m tests.nats_core.venv

# The monitoring tests scrape a mesh with a real Prometheus server, a Debian package.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing the prometheus Debian package (the monitoring tests' scraper)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null \
	  || { echo "could not install prometheus: run 'apt-get install prometheus' as root"; exit 1; }; }

# The tests of meshbus top run it in a terminal of tmux's, a Debian package.
tmux:
	@command -v tmux >/dev/null 2>&1 || { \
	  echo "installing the tmux Debian package (the terminal of meshbus top's tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null \
	  || { echo "could not install tmux: run 'apt-get install tmux' as root"; exit 1; }; }

# One worker more than the cores: a test spends much of its time waiting on brokers,
# JVMs and timers, and the extra worker fills that time (pytest on 2 cores: 7 min 19 s
# with 3 workers, the CPU 97 % busy; 8 min 24 s with 2). The Spark tests share one worker, so
# one JVM (tests/conftest.py).
PYTEST_WORKERS ?= -n $(shell echo $$(( $$(nproc) + 1 ))) --dist loadgroup

# The codec's, the NATS parser's and the client's tests run twice: with the compiled hot
# path (the whole suite) and on the pure-Python source (MESHBUS_NO_EXTENSIONS=1), which
# is what runs where no extension could be built. The NATS connections' and router's
# tests drive the parser and its encoders as the listener does. The pure leg needs no
# extension, so it runs while the extension is built (one process: ~20 s of one core).
PURE_LEG_TESTS := tests/unit/protocol tests/unit/broker/nats tests/unit/client tests/unit/test_compiled.py
pure-leg: $(STAMP)
	MESHBUS_NO_EXTENSIONS=1 $(BIN)/pytest -q -n 0 $(PURE_LEG_TESTS)

# The checks, the pure leg, the extension's build and the nats-core venv side by side:
# none needs another (the Debian installs before them stay one at a time: dpkg's lock),
# each one's output printed whole when it ends.
test: nats-server nats-js prometheus tmux $(STAMP)
	$(MAKE) --no-print-directory --output-sync=target -j5 lint typecheck pure-leg $(COMPILED) nats-core
	$(BIN)/pytest -q $(PYTEST_WORKERS)

unit: $(COMPILED)
	$(BIN)/pytest -q $(PYTEST_WORKERS) tests/unit

integration: $(COMPILED) nats-server nats-js nats-core prometheus tmux
	$(BIN)/pytest -q $(PYTEST_WORKERS) tests/integration

demo: $(COMPILED)
	$(BIN)/python -m meshbus.demo

# The API reference of the public surface (meshbus.__all__), from the docstrings, in
# build/docs/; it fails on a pdoc warning or an undocumented name (make test checks it).
docs: $(STAMP)
	$(BIN)/python docs/api_reference.py build/docs
	@echo "API reference: build/docs/index.html"

# The benchmark rig of this checkout (bench/, not part of the package), e.g.
# make bench ARGS="unicast --vs-nats"; without ARGS, the list of benchmarks.
ARGS ?= --help
bench: $(COMPILED) nats-server
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build src/*.egg-info
	find src -name '*.so' -delete
