#!/usr/bin/env bash
# Fetches Mesa's lavapipe (a CPU Vulkan driver) from Debian bookworm-backports into DEST and writes
# DEST/lvp_icd.json. SAPIEN (ManiSkill) needs Vulkan even for state-only steps; Debian 12's own
# lavapipe (Mesa 22.3) is rejected by it, Mesa 25's works. Nothing is installed system-wide: point
# VK_ICD_FILENAMES at DEST/lvp_icd.json (the Makefile does where no GPU driver is present).
# Needs apt-get and the libvulkan1 loader. Machines with an NVIDIA driver do not need this.
#   deploy/vulkan/fetch-lavapipe.sh DEST
set -euo pipefail
dest=${1:?usage: fetch-lavapipe.sh DEST}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
[ -s "$dest/lvp_icd.json" ] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial"
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
echo "deb $mirror bookworm-backports main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=-
          -o "Dir::State::lists=$work/lists" -o "Dir::Cache::archives=$work/archives"
          -o APT::Sandbox::User=root -o Debug::NoLocking=1)
apt-get "${apt_opts[@]}" -q update >/dev/null
# Only the driver: its libraries (LLVM 15, libdrm, xcb) are the machine's own bookworm packages.
(cd "$work" && apt-get "${apt_opts[@]}" -q download mesa-vulkan-drivers >/dev/null)
dpkg-deb -x "$work"/mesa-vulkan-drivers_*.deb "$work/root"
lib=$(find "$work/root" -name libvulkan_lvp.so | head -n1)
[ -n "$lib" ] || { echo "fetch-lavapipe: no libvulkan_lvp.so in the package" >&2; exit 1; }
cp "$lib" "$dest/libvulkan_lvp.so"
version=$(dpkg-deb -f "$work"/mesa-vulkan-drivers_*.deb Version)
cat > "$dest/lvp_icd.json" <<JSON
{"file_format_version": "1.0.0",
 "ICD": {"library_path": "$dest/libvulkan_lvp.so", "api_version": "1.4.305"},
 "mesa_version": "$version"}
JSON
echo "fetch-lavapipe: Mesa $version lavapipe in $dest"
