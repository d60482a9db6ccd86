#!/usr/bin/env bash
# A separate virtual environment with verl (PyPI `verl`) and this project, for the verl integration's
# tests (envserve.integrations.verl, tests/integrations/test_verl.py) on machines without a GPU:
#
#   deploy/trainer/verl-venv.sh [VENV]          # default VENV: .verl-venv
#   ENVSERVE_TEST_VERL=1 VENV/bin/python -m pytest -q tests/integrations/test_verl.py
#
# Separate from .venv because verl 0.9 pins transformers to >=5.5.3,<5.11 (the project's dev extra
# pins 5.23) and tensordict to <=0.10, and pulls ray, wandb and hydra. verl itself declares no torch:
# the CPU build is installed first (from a local wheel where pip finds one) and held there, so no
# later step swaps it for a CUDA build. verl's inference engines (vllm, sglang) are not installed:
# the tests put a real Hugging Face model behind verl's generate interface instead. About 80 s on a
# 2-core machine from an empty venv (torch from a local wheel where pip finds one), 1.9 GB on disk.
set -euo pipefail

VENV=${1:-.verl-venv}
PYTHON=${PYTHON:-python3}
VERL_VERSION=${VERL_VERSION:-0.9.1}
TORCH=${TORCH:-torch==2.13.0}
# The newest transformers verl 0.9.1 accepts.
TRANSFORMERS=${TRANSFORMERS:-transformers==5.10.4}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first, then held by a constraint for every later step.
"$VENV/bin/pip" install -q "$TORCH"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/pip" freeze --exclude-editable | grep -i '^torch==' > "$constraints"
# verl's agent loop imports some of its `verl-core` extra (cachetools, fastapi, uvicorn, pyzmq, msgspec)
# without declaring them; the rest of that extra (TransferQueue, torchcodec, nvtx...) is not needed.
"$VENV/bin/pip" install -q -c "$constraints" "verl==$VERL_VERSION" "$TRANSFORMERS" \
  cachetools fastapi uvicorn pyzmq msgspec
# The project on top, held to the versions verl chose (its transformers stays): the grid envs, the
# client and the trainer's random-weight model and tokenizer for the tests.
"$VENV/bin/pip" freeze --exclude-editable > "$constraints"
"$VENV/bin/pip" install -q -c "$constraints" -e "$ROOT[grid]" -e "$ROOT/trainer[hf]" \
  "pytest>=8" "pytest-timeout>=2" "pytest-asyncio>=0.23" "pytest-randomly>=3.15"
"$VENV/bin/python" -c "import verl, torch, transformers; print('verl', verl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
