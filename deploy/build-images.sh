#!/usr/bin/env bash
# Builds the envserve images (one per environment family, the HTTP facade, the judge, the trainer) with docker or podman.
#   deploy/build-images.sh [--engine docker|podman] [--base-image IMAGE] [--registry REGISTRY] [--tag TAG]
#                          [--pip-cert PATH] [--wheels DIR] [--build-arg KEY=VALUE]... [--push] [--dry-run]
#                          [--all | IMAGE...]
# IMAGE: grid, webshop, scienceworld, alfworld, svg, navigation, maniskill, web, judge, trainer (CPU torch),
# trainer-cuda (CUDA torch and vLLM; needs the network), redis (a local Redis for machines with no registry).
# Default: grid web judge trainer, what the k8s overlays deploy as shipped. --all: every image a k8s
# component deploys (the seven families, web, judge, trainer).
# Each is tagged REGISTRY/envserve-<name>:TAG (default localhost/envserve-<name>:latest: the same name under
# docker and podman), built from deploy/Dockerfile with FAMILY=<name> (trainer-cuda: FAMILY=trainer and the
# CUDA arguments). --push pushes each after its build. --dry-run prints the commands and runs nothing.
# --wheels DIR: a folder of wheels pip prefers (the trainer's or maniskill's torch), for machines that cannot
# reach the PyTorch index; with it, --build-arg TORCH_INDEX_URL= (empty: PyPI for the rest).
set -euo pipefail
cd "$(dirname "$0")/.."

engine=""
base_image=python:3.11-slim
registry=localhost
tag=latest
push=0
dry_run=0
all=0
pip_cert=""
wheels=""
build_args=()
images=()

usage() { sed -n '2,15s/^# \{0,1\}//p' "$0"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine=$2; shift 2 ;;
    --base-image) base_image=$2; shift 2 ;;
    --registry) registry=${2%/}; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --push) push=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --all) all=1; shift ;;
    --pip-cert) pip_cert=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --build-arg) build_args+=(--build-arg "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    *) images+=("$1"); shift ;;
  esac
done

# What the overlays in k8s/overlays deploy as shipped (their components: family-grid, web, judge, trainer),
# and every image some component in k8s/components deploys. tests/deploy/test_k8s_manifests.py checks both
# against the rendered manifests.
DEFAULT_IMAGES=(grid web judge trainer)
ALL_IMAGES=(grid webshop scienceworld alfworld svg navigation maniskill web judge trainer)
if [ "$all" = 1 ]; then
  [ ${#images[@]} -eq 0 ] || { echo "--all builds every image; name none besides it" >&2; exit 2; }
  images=("${ALL_IMAGES[@]}")
fi
[ ${#images[@]} -gt 0 ] || images=("${DEFAULT_IMAGES[@]}")
[ -n "$registry" ] || { echo "--registry needs a value (default: localhost)" >&2; exit 2; }

# A docker CLI without a reachable daemon does not count: prefer a working docker, else podman.
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  elif [ "$dry_run" = 1 ]; then engine=docker
  else echo "no container engine: install docker or podman, or pass --engine" >&2; exit 1
  fi
fi

# --dry-run: print each command, shell-quoted, instead of running it.
run() {
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi
}

args=(--build-arg "BASE_IMAGE=$base_image")
case "$(basename "$engine")" in
  # OCI images drop HEALTHCHECK; the docker format keeps it. --layers caches like docker does.
  podman) args+=(--format docker --layers) ;;
  docker) export DOCKER_BUILDKIT=1 ;;  # RUN --mount=type=secret needs BuildKit
esac
if [ -n "$pip_cert" ]; then
  [ -r "$pip_cert" ] || [ "$dry_run" = 1 ] || { echo "--pip-cert $pip_cert is not readable" >&2; exit 1; }
  args+=(--secret "id=pipcert,src=$pip_cert")
fi

if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || [ "$dry_run" = 1 ] || { echo "--wheels $wheels is not a directory" >&2; exit 1; }
fi

# The CUDA trainer: vLLM 0.33.0 pins torch==2.14.0 and its kernels are built against PyPI's (CUDA) torch,
# hence the empty index. docker-compose.gpu.yml passes the same arguments.
TRAINER_CUDA_ARGS=(--build-arg CUDA=1 --build-arg TORCH_INDEX_URL= --build-arg TORCH_REQUIREMENT=torch==2.14.0
                   --build-arg TRAINER_EXTRAS=hf,plot,vllm)

# Every name this script builds; each is a stage of deploy/Dockerfile (trainer-cuda: the trainer's).
IMAGES=(grid webshop scienceworld alfworld svg navigation maniskill web judge trainer trainer-cuda redis)
dockerfile=deploy/Dockerfile

for name in "${images[@]}"; do
  case " ${IMAGES[*]} " in
    *" $name "*) ;;
    *) echo "unknown image $name; one of: ${IMAGES[*]}" >&2; exit 2 ;;
  esac
  variant=()
  case "$name" in
    trainer-cuda) family=trainer; variant=("${TRAINER_CUDA_ARGS[@]}") ;;
    *) family=$name ;;
  esac
  # The "wheels" stage that this context replaces is where pip looks for local wheels first.
  context=()
  if [ -n "$wheels" ]; then
    context=(--build-context "wheels=$wheels")
  fi
  # A fully qualified name: an unqualified one is docker.io/library/... under docker but localhost/...
  # under podman, and a cluster's runtime would look for the docker.io one.
  ref="$registry/envserve-$name:$tag"
  start=$(date +%s)
  [ "$dry_run" = 1 ] || echo "== building $ref from $base_image with $engine"
  # The caller's --build-arg comes last, so it overrides a variant's.
  run "$engine" build "${args[@]}" --build-arg "FAMILY=$family" "${variant[@]}" "${build_args[@]}" "${context[@]}" \
    -f "$dockerfile" -t "$ref" .
  [ "$push" = 0 ] || run "$engine" push "$ref"
  [ "$dry_run" = 1 ] || echo "== $ref built in $(( $(date +%s) - start )) s"
done
