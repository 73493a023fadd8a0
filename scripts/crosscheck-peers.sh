#!/usr/bin/env bash
# make crosscheck-peers: kvplug's greedy tokens against llama.cpp's on the same GGUF files,
# an oracle that shares no code with kvplug (tokenizer, architectures, block formats).
#
# llama.cpp is the .peers build of scripts/peers-llama-cpp.sh, driven in process through the
# ctypes bindings of the same llama-cpp-python sdist, in a Python venv in .peers/venv (numpy
# and the bindings' imports from PyPI; the `gguf` package is llama.cpp's own gguf-py).
# scripts/crosscheck/synth_gguf.py writes random-weight f32 GGUFs of the architecture
# variants the demo model lacks (qwen3, qwen2 with tied embeddings, Llama 3 with rope_freqs
# and the llama-bpe pre-tokenizer, llama with a separate output matrix), with MODEL's
# vocabulary; llama-quantize makes QUANT copies of them. Then scripts/crosscheck/greedy.py
# decodes N tokens greedily on both sides from each prompt below and compares the ids:
#   - the f32 files: llama.cpp and kvplug then do the same f32 arithmetic up to summation
#     order, so ids must agree unless llama.cpp's two best logits are within FLIP_GAP (fails
#     otherwise);
#   - the QUANT copies and MODEL itself (weights in their block formats): both sides quantize
#     activations, each its own way (kvplug: int8 per 32 values; llama.cpp: per its formats'
#     dot types), so a divergence at a near tie is expected; reported, not failed.
# Settings (environment): MODEL (default the demo model), N (tokens, default 32), QUANT
# (llama-quantize type, default Q4_K_M), BACKENDS (comma list, default cpu), FLIP_GAP
# (default 0.01).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_WHO=crosscheck-peers

MODEL=${MODEL:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
N=${N:-32}
QUANT=${QUANT:-Q4_K_M}
BACKENDS=${BACKENDS:-cpu}
FLIP_GAP=${FLIP_GAP:-0.01}
[ -f "$MODEL" ] || { echo "crosscheck-peers: no model at $MODEL (make models fetches the demo model)" >&2; exit 2; }

source scripts/peers-llama-cpp.sh

venv="$PEERS/venv"
if ! "$venv/bin/python" -c 'import numpy, yaml, diskcache, jinja2, typing_extensions' 2>/dev/null; then
    echo "crosscheck-peers: a Python venv with numpy and the bindings' imports in $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q numpy pyyaml diskcache jinja2 typing_extensions
fi
sdist="$PEERS/llama_cpp_python-$VERSION"
export PYTHONPATH="$sdist:$sdist/vendor/llama.cpp/gguf-py"
export LLAMA_CPP_LIB_PATH="$build/bin"

cargo build --release --quiet
kvplug=./target/release/kvplug
plugins=target/release

models="$PEERS/crosscheck"
mkdir -p "$models"
if [ ! -f "$models/done" ]; then
    "$venv/bin/python" scripts/crosscheck/synth_gguf.py "$MODEL" "$models" >/dev/null
    touch "$models/done"
fi

prompts=(
    "The capital of France is"
    "def reverse(s: str) -> str:
    \"\"\"Reverse a string.\"\"\"
   "
    "I'm 12345 years old, THEY'RE  here!	naïve café, 東京タワー 🦜 x=1;y=22;z=333"
)

failed=0
check() { # FILE MAX_FLIP_GAP
    local b p
    for b in ${BACKENDS//,/ }; do
        for p in "${prompts[@]}"; do
            "$venv/bin/python" scripts/crosscheck/greedy.py "$kvplug" "$plugins" "$1" "$N" "$p" \
                "$b" "$2" || failed=1
        done
    done
}

echo "## f32 weights (ids must agree except at near ties: llama.cpp's top-2 gap <= $FLIP_GAP)"
for f in "$models"/*.f32.gguf; do
    check "$f" "$FLIP_GAP"
done
echo "## $QUANT copies and $MODEL (reported only)"
for f in "$models"/*.f32.gguf; do
    q="${f%.f32.gguf}.$QUANT.gguf"
    if [ ! -f "$q" ]; then
        "$build/bin/llama-quantize" "$f" "$q.tmp" "$QUANT" >"$models/quantize.log" 2>&1 \
            || { cat "$models/quantize.log" >&2; exit 1; }
        mv "$q.tmp" "$q"
    fi
    check "$q" -1
done
check "$MODEL" -1
exit $failed
