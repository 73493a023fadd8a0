#!/usr/bin/env bash
# Runs cli/tests/openai_client.py (the official `openai` Python client) against a running
# `kvplug serve`: openai-client.sh BASE_URL API_KEY. Makes the venv it needs on first use, in
# the git-ignored .venv/openai, with the pinned client from PyPI.
set -euo pipefail

OPENAI_VERSION=3.54.0
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv/openai"

if ! "$venv/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    echo "openai-client: making $venv (openai==$OPENAI_VERSION from PyPI)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
fi
exec "$venv/bin/python" "$root/cli/tests/openai_client.py" "$@"
