#!/usr/bin/env bash
# envserve's conformance suite against this package's env: what every served environment must do
# (spec, lifecycle, seeds the same across processes, forks, config errors...), through the protocol.
#
#   pip install -e examples/my_env_package      # into the venv that has envserve
#   examples/my_env_package/run_conformance.sh
#
# The suite starts two `envserve serve guess` processes of its own. To test servers already running
# (the Docker image, a cluster): ENVSERVE_CONFORMANCE_ADDRESSES=host:port,host:port. ENVSERVE_REPO is
# a checkout of envserve (the suite is its tests/conformance; this folder's repository by default).
# PYTHON is the venv's interpreter (default: `python` on PATH, so activate the venv or set
# PYTHON=.venv/bin/python; elsewhere the suite stops at `No module named 'grpc'`).
# Extra arguments go to pytest.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=${ENVSERVE_REPO:-$(cd "$HERE/../.." && pwd)}
PYTHON=${PYTHON:-python}
export ENVSERVE_CONFORMANCE_ENVS=${ENVSERVE_CONFORMANCE_ENVS:-guess}
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$REPO/tests/conformance" "$@"
