# envserve: `make run` (the demo stack on embedded defaults) and `make test` (the whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
PYTEST_ARGS ?=
# Wheels of the source-only dependencies (alfworld's jericho and fast-downward, about 1-2 min to
# build), kept outside git and reused by every later install; point it at a CI cache folder.
WHEELHOUSE ?= $(or $(ENVSERVE_WHEELHOUSE),.wheelhouse)
SOURCE_ONLY = jericho==3.3.1 fast-downward-textworld==20.6.4

.PHONY: run test install wheels proto bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(MAKE) --no-print-directory wheels
	$(PIP) install -q --find-links $(WHEELHOUSE) -e ".[grid,gym,scienceworld,alfworld,directory,web,containers,dev]"
	touch $@

# Builds each source-only wheel once; a wheel already in the wheelhouse is not rebuilt.
wheels:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	mkdir -p $(WHEELHOUSE)
	for req in $(SOURCE_ONLY); do \
	  name=$$(echo $$req | cut -d= -f1 | tr - _); ver=$$(echo $$req | cut -d= -f3); \
	  ls $(WHEELHOUSE)/$$name-$$ver-*.whl >/dev/null 2>&1 || $(PIP) wheel -q --no-deps -w $(WHEELHOUSE) $$req; \
	done

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
