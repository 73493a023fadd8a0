#!/usr/bin/env bash
# make bench-gpu's runner: a Python with the `gguf` package (target/bench-gpu/venv, made from
# PyPI on first use; PYTHON=... uses another), then scripts/bench_gpu.py with the arguments
# given (its --help says which). The release build is the Makefile's part.
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
exec "$py" scripts/bench_gpu.py "$@"
