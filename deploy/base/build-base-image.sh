#!/usr/bin/env bash
# Builds a minimal Debian base image (python3, venv, pip, CA certificates) with debootstrap and imports
# it into the container engine. For machines that cannot pull python:3.11-slim from a registry; the
# family Dockerfiles then build with --build-arg BASE_IMAGE=<this image>. Needs root (debootstrap).
# Idempotent: does nothing when the image already exists (--force rebuilds it).
set -euo pipefail

image=localhost/envserve-base:bookworm
suite=bookworm
engine=""
mirror=""
force=0

usage() {
  cat <<USAGE
usage: $0 [--image NAME] [--suite SUITE] [--engine podman|docker] [--mirror URL] [--force]
  --image   tag to import as (default $image)
  --suite   Debian suite (default $suite)
  --engine  container engine (default: a docker whose daemon answers, else podman)
  --mirror  Debian mirror (default: the one apt uses, from /etc/apt/sources.list.d/*.sources
            or /etc/apt/sources.list)
  --force   rebuild even when the image exists
USAGE
}

while [ $# -gt 0 ]; do
  case "$1" in
    --image) image=$2; shift 2 ;;
    --suite) suite=$2; shift 2 ;;
    --engine) engine=$2; shift 2 ;;
    --mirror) mirror=$2; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done

# Same choice as deploy/build-images.sh, so the base lands where the family images are built.
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  else echo "neither a running docker nor podman found" >&2; exit 1
  fi
fi

if [ "$force" = 0 ] && "$engine" image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image exists; skipping (--force rebuilds)"
  exit 0
fi

# The mirror apt already uses on this machine: the first URI of a deb822 stanza that lists the suite,
# else a one-line "deb URI suite ..." entry. Nothing is hard-coded, so the script works behind any
# mirror or snapshot the host is set up for.
find_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$suite" '
      function flush() { if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uri != "") { print uri; found = 1; exit } }
      /^[[:space:]]*$/ { flush(); types = ""; uris = ""; suites = ""; uri = ""; next }
      /^[[:space:]]*#/ { next }
      tolower($1) == "types:"  { $1 = ""; types = $0 }
      tolower($1) == "uris:"   { uri = $2 }
      tolower($1) == "suites:" { $1 = ""; suites = $0; gsub(/^ +| +$/, "", suites) }
      END { if (!found) flush() }
    ' "$f" | head -n1
  done
  if [ -f /etc/apt/sources.list ]; then
    awk -v suite="$suite" '$1 == "deb" && $0 !~ /^#/ { u = $2; s = $3; if ($2 ~ /^\[/) { u = $3; s = $4 } if (s == suite) { print u; exit } }' /etc/apt/sources.list
  fi
}
if [ -z "$mirror" ]; then
  mirror=$(find_mirror | head -n1)
fi
if [ -z "$mirror" ]; then
  echo "no Debian mirror for '$suite' found in apt's sources; pass --mirror URL" >&2
  exit 1
fi

[ "$(id -u)" = 0 ] || { echo "debootstrap needs root: run this script as root (or with sudo)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

keyring_args=()
for k in /usr/share/keyrings/debian-archive-keyring.gpg; do
  [ -f "$k" ] && keyring_args=(--keyring "$k")
done

work=$(mktemp -d "${TMPDIR:-/var/tmp}/envserve-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/rootfs

start=$(date +%s)
echo "debootstrap $suite from $mirror into $root"
debootstrap --variant=minbase "${keyring_args[@]}" \
  --include=python3,python3-venv,python3-pip,ca-certificates \
  "$suite" "$root" "$mirror"

# Smaller image (about 110 MB less): no package caches, lists, docs or translations. Dockerfiles that
# need apt run apt-get update first.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
       "$root"/var/log/* "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
       "$root"/usr/share/locale/* "$root"/tmp/*
# Name resolution comes from the engine at run time, not from this machine.
: > "$root/etc/resolv.conf"
rm -f "$root/etc/hostname"

tar --numeric-owner --xattrs -C "$root" -c . | "$engine" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  - "$image"
echo "imported $image in $(( $(date +%s) - start )) s"
