#!/usr/bin/env bash
# make bench-hybrid: kvplug against llama.cpp on the hybrid (recurrent-state) models, as
# ratios: random-weight f32 files of the LFM2-350M and Qwen3.5-0.8B shapes written by
# scripts/crosscheck/synth_gguf.py (no real weights of these families are on PyPI), made
# Q4_K_M by the same llama.cpp's llama-quantize, then scripts/bench-peers.sh on each (pp512
# and tg128 interleaved, 2 rounds, peak RSS holding 1024 tokens). The tables go to
# .peers/peers-hybrid-NAME.md (-avx2.md at ISA=avx2), which `make bench` puts in
# backends/cpu/BENCH.md.
#
# Settings (environment): MODEL (the GGUF whose vocabulary the files copy; default the demo
# model), QUANT (default Q4_K_M), and bench-peers.sh's own (THREADS, ROUNDS, REPS, ISA, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_WHO=bench-hybrid

MODEL=${MODEL:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
QUANT=${QUANT:-Q4_K_M}
[ -f "$MODEL" ] || { echo "bench-hybrid: no model at $MODEL (make models fetches the demo model)" >&2; exit 2; }

source scripts/peers-llama-cpp.sh
peers_python

# The files are remade when MODEL (their vocabulary) or the generator changes.
shapes=(lfm2-350m-shaped qwen35-0.8b-shaped)
dir="$PEERS/hybrid"
made_from="$MODEL $QUANT $(sha256sum scripts/crosscheck/synth_gguf.py | cut -d' ' -f1)"
if [ "$(cat "$dir/made-from" 2>/dev/null)" != "$made_from" ]; then
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "bench-hybrid: writing ${shapes[*]} ($QUANT) in $dir"
    "$venv/bin/python" scripts/crosscheck/synth_gguf.py "$MODEL" "$dir" bench "${shapes[@]}" \
        >/dev/null
    for s in "${shapes[@]}"; do
        "$build/bin/llama-quantize" "$dir/$s.f32.gguf" "$dir/$s.tmp" "$QUANT" \
            >"$dir/quantize.log" 2>&1 || { cat "$dir/quantize.log" >&2; exit 1; }
        mv "$dir/$s.tmp" "$dir/$s.$QUANT.gguf"
        rm "$dir/$s.f32.gguf"
    done
    echo "$made_from" >"$dir/made-from"
fi

for s in "${shapes[@]}"; do
    MODEL="$dir/$s.$QUANT.gguf" DEPTHS=0 RSS_CONTEXT=1024 \
        PEERS_TABLE="$PEERS/peers-hybrid-$s.md" ./scripts/bench-peers.sh
done
