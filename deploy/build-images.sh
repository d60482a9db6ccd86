#!/usr/bin/env bash
# Builds the envserve images (one per environment family, the HTTP facade, the judge) with docker or podman.
#   deploy/build-images.sh [--engine docker|podman] [--base-image IMAGE] [--tag TAG] [--pip-cert PATH] [IMAGE...]
# IMAGE names a folder of deploy/ with a Dockerfile: grid, web, judge (the default set), redis (a local Redis
# for machines with no registry). Each is tagged envserve-<name>:<tag>.
set -euo pipefail
cd "$(dirname "$0")/.."

engine=""
base_image=python:3.11-slim
tag=latest
pip_cert=""
images=()

usage() { sed -n '2,5s/^# \{0,1\}//p' "$0"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine=$2; shift 2 ;;
    --base-image) base_image=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --pip-cert) pip_cert=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    *) images+=("$1"); shift ;;
  esac
done
[ ${#images[@]} -gt 0 ] || images=(grid web judge)

# A docker CLI without a reachable daemon does not count: prefer a working docker, else podman.
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  else echo "no container engine: install docker or podman, or pass --engine" >&2; exit 1
  fi
fi

args=(--build-arg "BASE_IMAGE=$base_image")
case "$(basename "$engine")" in
  # OCI images drop HEALTHCHECK; the docker format keeps it. --layers caches like docker does.
  podman) args+=(--format docker --layers) ;;
  docker) export DOCKER_BUILDKIT=1 ;;  # RUN --mount=type=secret needs BuildKit
esac
if [ -n "$pip_cert" ]; then
  [ -r "$pip_cert" ] || { echo "--pip-cert $pip_cert is not readable" >&2; exit 1; }
  args+=(--secret "id=pipcert,src=$pip_cert")
fi

for name in "${images[@]}"; do
  dockerfile=deploy/$name/Dockerfile
  [ -f "$dockerfile" ] || { echo "no $dockerfile" >&2; exit 2; }
  start=$(date +%s)
  echo "== building envserve-$name:$tag from $base_image with $engine"
  "$engine" build "${args[@]}" -f "$dockerfile" -t "envserve-$name:$tag" .
  echo "== envserve-$name:$tag built in $(( $(date +%s) - start )) s"
done
