#!/usr/bin/env bash
# Usage: scripts/install-lavapipe.sh MAKEFILE_FRAGMENT
# The software Vulkan driver the wgpu backend's tests run on (lavapipe), newer than Debian
# 12's own where that is the system: Mesa 25 from bookworm-backports, unpacked into
# .deps/lavapipe (git-ignored; the system's Mesa is left as it is) and named by the make
# fragment written to MAKEFILE_FRAGMENT, which the Makefile includes:
# `export VK_ICD_FILENAMES ?= .../lvp_icd.json` (a VK_ICD_FILENAMES or VK_DRIVER_FILES set
# by the caller still wins; the fragment checks at each run that the driver is still there
# and that no GPU has appeared, whose driver the wgpu tests then take). Elsewhere, or when
# the download fails, the fragment says why at each run and the system's driver is used;
# deleting it runs this script again. The version is pinned: a newer upload may need
# libraries Debian 12 lacks, so taking one is a deliberate change here.
#
# Why: bookworm's lavapipe (Mesa 22.3) runs compute shaders at a quarter to a sixth of
# Mesa 25's speed on the same LLVM 15. A plain f32 dot-product shader (1536 x 576) ran at 63
# vs 210 MMAC/s on a 2-core EPYC; kvplug's wgpu decode on Qwen2.5-0.5B Q4_K_M at 0.04 vs 0.24
# tok/s, its prefill at 0.04 vs 0.15: the wgpu half of the model tests was most of CI's time.
set -euo pipefail
out=$(realpath -m -- "$1")
mkdir -p "$(dirname "$out")"
cd "$(dirname "$0")/.."
version=25.0.7-2~bpo12+1
dest=.deps/lavapipe
icd=$dest/lvp_icd.json

fragment() {
    { echo "# Written by scripts/install-lavapipe.sh (delete it to run the script again)."
        printf '%s\n' "$@"; } >"$out.part"
    mv "$out.part" "$out"
}
system_driver() {
    rm -rf "$dest.part"
    echo "install-lavapipe: $1; the wgpu tests use the system's Vulkan driver" >&2
    fragment "\$(info install-lavapipe: $1; the wgpu tests use the system's Vulkan driver (delete $out to try again))"
    exit 0
}

codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}") || codename=
if [ "$(uname -m)" != x86_64 ] || [ "$codename" != bookworm ]; then
    system_driver "not Debian 12 on x86_64 (newer Debians ship Mesa 25 themselves)"
fi
if compgen -G "/dev/dri/renderD*" >/dev/null || compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
    system_driver "a GPU is present"
fi
if [ ! -f "$icd" ]; then
    echo "install-lavapipe: Mesa $version's lavapipe from bookworm-backports into $dest"
    mkdir -p .deps
    rm -rf "$dest.part"
    debs=$(./scripts/apt-unpack.sh bookworm-backports "$dest.part/apt" "$dest.part/root" \
        "mesa-vulkan-drivers=$version") ||
        system_driver "mesa-vulkan-drivers $version could not be downloaded from bookworm-backports"
    # Only lavapipe is kept (the package's other drivers need hardware and newer libdrm). A
    # library_path with a slash is relative to the manifest (the Vulkan loader's rule).
    { mkdir -p "$dest.part/lib" &&
        mv "$dest.part/root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so" "$dest.part/lib/" &&
        sed 's#"library_path": *"[^"]*"#"library_path": "./lib/libvulkan_lvp.so"#' \
            "$dest.part/root/usr/share/vulkan/icd.d/lvp_icd.json" >"$dest.part/lvp_icd.json" &&
        grep -q '"./lib/libvulkan_lvp.so"' "$dest.part/lvp_icd.json"; } ||
        system_driver "the mesa-vulkan-drivers package holds no lavapipe where expected"
    echo "$debs" >"$dest.part/INSTALLED"
    rm -rf "$dest.part/apt" "$dest.part/root" "$dest"
    mv "$dest.part" "$dest"
fi
echo "install-lavapipe: $(cat "$dest/INSTALLED")"
fragment "ifneq (\$(wildcard \$(CURDIR)/$icd),)" \
    "ifeq (\$(wildcard /dev/dri/renderD* /dev/nvidia[0-9]*),)" \
    "export VK_ICD_FILENAMES ?= \$(CURDIR)/$icd" \
    "endif" "endif"
