#!/usr/bin/env bash
# Usage: scripts/install-lavapipe.sh MAKEFILE_FRAGMENT
# The software Vulkan driver the wgpu backend's tests run on (lavapipe), newer than Debian
# 12's own where that is the system: Mesa 25 from bookworm-backports, unpacked into
# .deps/lavapipe (git-ignored; the system's Mesa is left as it is) and named by the make
# fragment written to MAKEFILE_FRAGMENT, which the Makefile includes:
# `export VK_ICD_FILENAMES ?= .../lvp_icd.json` (a VK_ICD_FILENAMES or VK_DRIVER_FILES set
# by the caller still wins). Elsewhere, on a machine with a GPU (whose driver the wgpu tests
# then take), or when the download fails, the fragment says why and the system's driver is
# used.
#
# Why: bookworm's lavapipe (Mesa 22.3) runs compute shaders at a quarter to a sixth of
# Mesa 25's speed on the same LLVM 15. A plain f32 dot-product shader (1536 x 576) ran at 63
# vs 210 MMAC/s on a 2-core EPYC; kvplug's wgpu decode on Qwen2.5-0.5B Q4_K_M at 0.04 vs 0.24
# tok/s, its prefill at 0.04 vs 0.15: the wgpu half of the model tests was most of CI's time.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
dest=.deps/lavapipe
icd=$dest/lvp_icd.json

fragment() {
    { echo "# Written by scripts/install-lavapipe.sh (delete it to run the script again)."; echo "$@"; } >"$out.part"
    mv "$out.part" "$out"
}
system_driver() {
    echo "install-lavapipe: $1; the wgpu tests use the system's Vulkan driver" >&2
    fragment "# $1: the system's Vulkan driver."
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
    echo "install-lavapipe: Mesa's lavapipe from bookworm-backports into $dest"
    mkdir -p .deps
    rm -rf "$dest.part"
    if ! debs=$(./scripts/apt-unpack.sh bookworm-backports "$dest.part/apt" "$dest.part/root" \
        mesa-vulkan-drivers); then
        rm -rf "$dest.part"
        system_driver "bookworm-backports' mesa-vulkan-drivers could not be downloaded"
    fi
    # Only lavapipe is kept (the package's other drivers need hardware and newer libdrm).
    mkdir -p "$dest.part/lib"
    mv "$dest.part/root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so" "$dest.part/lib/"
    # A library_path with a slash is relative to the manifest (Vulkan loader's rule).
    sed 's#"library_path": *"[^"]*"#"library_path": "./lib/libvulkan_lvp.so"#' \
        "$dest.part/root/usr/share/vulkan/icd.d/lvp_icd.json" >"$dest.part/lvp_icd.json"
    grep -q '"./lib/libvulkan_lvp.so"' "$dest.part/lvp_icd.json"
    echo "$debs" >"$dest.part/INSTALLED"
    rm -rf "$dest.part/apt" "$dest.part/root" "$dest"
    mv "$dest.part" "$dest"
fi
echo "install-lavapipe: $(cat "$dest/INSTALLED")"
fragment "export VK_ICD_FILENAMES ?= \$(CURDIR)/$icd"
