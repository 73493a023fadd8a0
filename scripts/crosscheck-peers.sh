#!/usr/bin/env bash
# make crosscheck-peers: kvplug's greedy tokens against llama.cpp's on the same GGUF files,
# an oracle that shares no code with kvplug (tokenizer, architectures, block formats).
#
# llama.cpp is the .peers build of scripts/peers-llama-cpp.sh, driven in process through the
# ctypes bindings of the same llama-cpp-python sdist, in a Python venv in .peers/venv (numpy
# and the bindings' imports from PyPI; the `gguf` package is llama.cpp's own gguf-py).
# scripts/crosscheck/synth_gguf.py writes random-weight f32 GGUFs of the architecture
# variants the demo model lacks (qwen3, qwen2 with tied embeddings, Llama 3 with rope_freqs
# and the llama-bpe pre-tokenizer with BOS left to the default, llama with a separate output
# matrix, and the hybrids and mixtures of experts: lfm2, qwen35, granitehybrid, qwen3moe,
# gpt-oss), with MODEL's vocabulary; llama-quantize makes QUANT copies of them. Then
# scripts/crosscheck/greedy.py decodes N tokens greedily on both sides from each prompt below
# and compares the prompt ids (must agree) and the generated ids:
#   - the f32 files with f32 K/V on both sides: llama.cpp and kvplug then both compute in
#     f32 (up to summation order), so the ids must agree unless kvplug's pick was within
#     FLIP_GAP of llama.cpp's best in llama.cpp's logits (fails otherwise);
#   - the QUANT copies and MODEL itself (weights in their block formats), f16 K/V: the two
#     sides round differently (kvplug's cpu quantizes activations to int8 per 32 values;
#     llama.cpp to its formats' dot types, and its f16-K/V attention rounds the query and
#     the probabilities to f16), so a divergence at a near tie is expected; reported, not
#     failed.
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

peers_python

cargo build --release --quiet
kvplug=./target/release/kvplug
plugins=target/release

# The files are remade when MODEL (their vocabulary) or the generator changes.
models="$PEERS/crosscheck"
made_from="$MODEL $(sha256sum scripts/crosscheck/synth_gguf.py | cut -d' ' -f1)"
if [ "$(cat "$models/made-from" 2>/dev/null)" != "$made_from" ]; then
    rm -rf "$models"
    mkdir -p "$models"
    "$venv/bin/python" scripts/crosscheck/synth_gguf.py "$MODEL" "$models" >/dev/null
    echo "$made_from" >"$models/made-from"
fi

prompts=(
    "The capital of France is"
    "def reverse(s: str) -> str:
    \"\"\"Reverse a string.\"\"\"
   "
    "I'm 12345 years old, THEY'RE  here!	naïve café, 東京タワー 🦜 x=1;y=22;z=333"
)

failed=0
check() { # FILE KV MAX_FLIP_GAP
    local b p
    for b in ${BACKENDS//,/ }; do
        for p in "${prompts[@]}"; do
            "$venv/bin/python" scripts/crosscheck/greedy.py "$kvplug" "$plugins" "$1" "$N" "$p" \
                "$b" "$2" "$3" || failed=1
        done
    done
}

echo "## f32 weights, f32 K/V (ids must agree but where kvplug's pick is within $FLIP_GAP of llama.cpp's best)"
for f in "$models"/*.f32.gguf; do
    check "$f" f32 "$FLIP_GAP"
done
echo "## $QUANT copies and $MODEL (reported only)"
for f in "$models"/*.f32.gguf; do
    q="${f%.f32.gguf}.$QUANT.gguf"
    if [ ! -f "$q" ]; then
        "$build/bin/llama-quantize" "$f" "$q.tmp" "$QUANT" >"$models/quantize.log" 2>&1 \
            || { cat "$models/quantize.log" >&2; exit 1; }
        mv "$q.tmp" "$q"
    fi
    check "$q" f16 -1
done
check "$MODEL" f16 -1
exit $failed
