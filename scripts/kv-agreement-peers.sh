#!/usr/bin/env bash
# make kv-agreement-peers: llama.cpp's own greedy agreement between f16 K/V and its other K/V
# types on MODEL (default the demo model), N tokens (default 64) after each of kv_quality's
# prompts: the anchor for kvplug's "KV dtype quality" table in backends/cpu/BENCH.md
# (scripts/crosscheck/kv_agreement.py says what it measures). llama.cpp is the .peers build
# of scripts/peers-llama-cpp.sh. Not part of make test.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_WHO=kv-agreement-peers
MODEL=${MODEL:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
N=${N:-64}
[ -f "$MODEL" ] || { echo "$PEERS_WHO: no model at $MODEL (make models fetches the demo model)" >&2; exit 2; }
source scripts/peers-llama-cpp.sh
peers_python
"$venv/bin/python" scripts/crosscheck/kv_agreement.py "$MODEL" "$N"
