#!/usr/bin/env bash
# make bench-speculation: speculative decoding by prompt lookup (`--speculative ngram`)
# against plain greedy decoding on the hybrid models, where llama.cpp cannot speculate at
# all. No hybrid's real weights are on PyPI and a random-weight model does not quote its
# prompt, so scripts/crosscheck/synth_gguf.py writes the LFM2-350M, Qwen3.5-0.8B and
# Granite-4.0-H-350M shapes as quoting models: the layers of the bench files (every matrix
# read, every state kept) with their block outputs scaled down and an output matrix that
# makes each token's greedy successor its successor in a set of copy-with-edits tasks (a
# 384-token document given as the prompt, answered with a fresh token inserted after every
# 64th, 16th, 8th or 4th). llama-quantize makes them Q4_K_M; scripts/bench_speculation.py
# runs each task both ways, interleaved, and checks the answers: through `kvplug run` (a
# tree cache) and through `kvplug serve` (a seq cache, chains). The tables go to
# .peers/speculation-hybrid.md.
#
# Settings (environment): MODEL (the GGUF whose vocabulary the files copy; default the demo
# model), QUANT (default Q4_K_M), SHAPES (default all three), ROUNDS (default 2; each runs
# plain, ngram, ngram, plain or the reverse), WAYS (default "run serve").
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_WHO=bench-speculation

MODEL=${MODEL:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
QUANT=${QUANT:-Q4_K_M}
ROUNDS=${ROUNDS:-2}
[ -f "$MODEL" ] || { echo "bench-speculation: no model at $MODEL (make models fetches the demo model)" >&2; exit 2; }

source scripts/peers-llama-cpp.sh
peers_python

read -r -a shapes <<<"${SHAPES:-lfm2-350m-shaped qwen35-0.8b-shaped granite-4.0-h-350m-shaped}"
dir="$PEERS/quoting"
mkdir -p "$dir"
files=()
for s in "${shapes[@]}"; do
    # Each file is written with its tasks; without them, it is written again.
    [ -f "$dir/$s-quoting.tasks.json" ] || rm -f "$dir/$s-quoting.made-from"
    synth_quantized "$dir" "$s" "$QUANT" quoting
    files+=("$dir/$s-quoting.$QUANT.gguf")
done

cargo build --release --quiet -p kvplug-cli -p kvplug-cpu
echo "bench-speculation: plain and ngram decoding, $ROUNDS rounds, interleaved, $(nproc) threads"
: >"$PEERS/speculation-hybrid.md"
for way in ${WAYS:-run serve}; do
    python3 scripts/bench_speculation.py ./target/release/kvplug target/release "$ROUNDS" \
        "$way" "${files[@]}" | tee -a "$PEERS/speculation-hybrid.md"
done
