#!/usr/bin/env bash
# Installs MLX (library, C++ headers, CMake config) into .deps/mlx (git-ignored) for the mlx
# backend, from the PyPI wheel that ships it; backends/mlx/build.rs finds it there (MLX_DIR
# overrides). Idempotent: an install of the pinned wheel is kept.
#   Linux x86_64: mlx-cpu (CPU device; its BLAS/LAPACK ride along in mlx_cpu.libs/)
#     The wheel's BLAS is the unoptimised reference (netlib) build, where MLX's CPU matmuls
#     spend most of a forward; it is pointed at the system OpenBLAS (same Fortran BLAS ABI,
#     libopenblas0-pthread from install-deps.sh) when that is installed: SmolLM2-135M prefill
#     6.4 -> 129 tok/s, decode 4.2 -> 9.7 tok/s on a 2-core machine.
#   macOS arm64:  mlx-metal (Metal device, unified memory)
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.32.4
case "$(uname -s)/$(uname -m)" in
Linux/x86_64)
    pkg=mlx-cpu platform=manylinux_2_35_x86_64
    sha=0e0a24fa2ce8b6b94d2e6a90604e8813aa8e29fcb918bb2aa01cfb6d133d8cee ;;
Darwin/arm64)
    pkg=mlx-metal platform=macosx_14_0_arm64
    sha=8019b2db622599267d66cc168b2f0dbf5af929790a6c3b3913e00eabc42a7947 ;;
*)
    echo "install-mlx: no MLX wheel for $(uname -s)/$(uname -m); the mlx plugin will report itself unavailable" >&2
    exit 0 ;;
esac

openblas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
blas=bundled
if [ "$pkg" = mlx-cpu ] && [ -e "$openblas" ]; then
    blas=$openblas
fi

dest=.deps/mlx
stamp="$dest/INSTALLED"
installed="$pkg==$version $sha blas=$blas"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$installed" ]; then
    echo "install-mlx: $pkg $version present"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "install-mlx: downloading $pkg $version from PyPI"
python3 -m pip download --no-deps --quiet --disable-pip-version-check --only-binary=:all: \
    --platform "$platform" -d "$tmp" "$pkg==$version"
wheel=$(ls "$tmp"/*.whl)
if ! echo "$sha  $wheel" | sha256sum --check --status; then
    echo "install-mlx: $wheel does not have the expected SHA-256 $sha" >&2
    exit 1
fi
# Unpacked whole: libmlx's RUNPATH points at its sibling mlx_cpu.libs/.
rm -rf "$dest.part" "$dest"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$dest.part"
if [ "$blas" != bundled ]; then
    for lib in "$dest.part"/mlx_cpu.libs/libblas-*.so*; do
        ln -sf "$blas" "$lib"
    done
fi
echo "$installed" > "$dest.part/INSTALLED"
mv "$dest.part" "$dest"
echo "install-mlx: MLX $version in $dest/mlx (BLAS: $blas)"
