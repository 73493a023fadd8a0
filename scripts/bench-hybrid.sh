#!/usr/bin/env bash
# make bench-hybrid: kvplug against llama.cpp on the hybrid (recurrent-state) and
# mixture-of-experts models, as ratios: random-weight f32 files of the LFM2-350M,
# Qwen3.5-0.8B and Granite-4.0-H-350M shapes, two Qwen3-MoE shapes with the same active size and 32 or 64 experts,
# and a GPT-OSS shape, written by scripts/crosscheck/synth_gguf.py (no real weights of these
# families are on PyPI), made Q4_K_M (the GPT-OSS shape MXFP4_MOE, as GPT-OSS ships) by the
# same llama.cpp's llama-quantize, then scripts/bench-peers.sh on each (pp512 and tg128
# interleaved, 2 rounds, peak RSS holding 1024 tokens). The tables go to
# .peers/peers-hybrid-NAME.md (-avx2.md at ISA=avx2), which `make bench` puts in
# backends/cpu/BENCH.md.
#
# Settings (environment): MODEL (the GGUF whose vocabulary the files copy; default the demo
# model), QUANT (default Q4_K_M), SHAPES (some of the shapes, by name; default all), and
# bench-peers.sh's own (THREADS, ROUNDS, REPS, ISA, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_WHO=bench-hybrid

MODEL=${MODEL:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
QUANT=${QUANT:-Q4_K_M}
[ -f "$MODEL" ] || { echo "bench-hybrid: no model at $MODEL (make models fetches the demo model)" >&2; exit 2; }

source scripts/peers-llama-cpp.sh
peers_python

all=(lfm2-350m-shaped qwen35-0.8b-shaped granite-4.0-h-350m-shaped qwen3moe-1b-a0.3b-shaped
    qwen3moe-2b-a0.3b-shaped gpt-oss-1b-a0.5b-shaped)
read -r -a shapes <<<"${SHAPES:-${all[*]}}"
quant_of() {
    case "$1" in
        gpt-oss-*) echo MXFP4_MOE ;;
        *) echo "$QUANT" ;;
    esac
}

# Each file is remade when MODEL (its vocabulary), its quantization or the generator changes.
dir="$PEERS/hybrid"
mkdir -p "$dir"
for s in "${shapes[@]}"; do
    synth_quantized "$dir" "$s" "$(quant_of "$s")" bench
done

for s in "${shapes[@]}"; do
    SHAPE= MODEL="$dir/$s.$(quant_of "$s").gguf" DEPTHS=0 RSS_CONTEXT=1024 \
        PEERS_TABLE="$PEERS/peers-hybrid-$s.md" ./scripts/bench-peers.sh
done
