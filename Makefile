# envserve: `make run` (the demo stack on embedded defaults) and `make test` (the whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: run test install proto bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[grid,gym,scienceworld,directory,web,containers,dev]"
	touch $@

install: $(VENV)/.installed

# Starts `envserve up` (all registered environments, worker processes, no Docker or Redis),
# plays a short episode on each grid environment with a scripted agent, prints the results.
run: install
	$(VENV)/bin/envserve demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerates the Python stubs from proto/ (a test fails when they disagree).
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=services --pyi_out=services \
		--grpc_python_out=services proto/envserve/v1/envserve.proto

bench: install
	$(PY) bench/step_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info services/*.egg-info
