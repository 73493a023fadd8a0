#!/usr/bin/env bash
# make bench-gpu's runner: a Python with the `gguf` package (target/bench-gpu/venv, made from
# PyPI on first use; PYTHON=... uses another), then scripts/bench_gpu.py with the arguments
# given (its --help says which). The release build is the Makefile's part. PEER=vulkan also
# builds llama.cpp's llama-bench with the Vulkan backend (scripts/peers-llama-cpp.sh) and
# runs it beside, on the same files.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
    venv=target/bench-gpu/venv
    if ! "$venv/bin/python" -c "import gguf" 2>/dev/null; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q "gguf==0.17.1"
    fi
    py=$venv/bin/python
fi
peer=()
if [ "${PEER:-}" = vulkan ]; then
    PEERS_BACKEND=vulkan PEERS_WHO=bench-gpu source scripts/peers-llama-cpp.sh
    peer=(--llama-bench "$build/bin/llama-bench")
elif [ -n "${PEER:-}" ]; then
    echo "bench-gpu: PEER must be vulkan or unset (got $PEER)" >&2
    exit 2
fi
exec "$py" scripts/bench_gpu.py "${peer[@]}" "$@"
