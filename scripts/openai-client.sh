#!/usr/bin/env bash
# Runs one of the Python test scripts in tests/cli/tests/: openai-client.sh [SCRIPT] ARGS...
# (SCRIPT defaults to openai_client.py, the `openai` Python client against a running `kvplug
# serve` at the BASE_URL in ARGS; agents_sdk.py drives the OpenAI Agents SDK; hf_template.py
# renders chat templates as Hugging Face transformers does, with Jinja2; anthropic_client.py
# drives the `anthropic` client against the Messages API). Makes the venv they need on first
# use, in the git-ignored .venv/openai, with the pinned packages from PyPI.
set -euo pipefail

OPENAI_VERSION=3.54.0
AGENTS_VERSION=0.24.0
JINJA2_VERSION=3.1.6
ANTHROPIC_VERSION=2.14.0
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv/openai"

# Tests run this script in parallel: one at a time checks (and, the first time, makes) the
# venv, so that none removes it while another installs into it.
mkdir -p "$root/.venv"
exec 9>"$root/.venv/openai.lock"
flock 9
if ! "$venv/bin/python" - "$OPENAI_VERSION" "$AGENTS_VERSION" "$JINJA2_VERSION" \
    "$ANTHROPIC_VERSION" 2>/dev/null <<'PY'
import importlib.metadata as m, sys
want = {"openai": sys.argv[1], "openai-agents": sys.argv[2], "jinja2": sys.argv[3],
        "anthropic": sys.argv[4]}
sys.exit(any(m.version(p) != v for p, v in want.items()))
PY
then
    echo "openai-client: making $venv (openai==$OPENAI_VERSION, openai-agents==$AGENTS_VERSION," \
        "jinja2==$JINJA2_VERSION, anthropic==$ANTHROPIC_VERSION from PyPI)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "openai==$OPENAI_VERSION" "openai-agents==$AGENTS_VERSION" "jinja2==$JINJA2_VERSION" \
        "anthropic==$ANTHROPIC_VERSION"
fi
exec 9>&-
script=openai_client.py
if [[ "${1:-}" == *.py ]]; then
    script=$1
    shift
fi
exec "$venv/bin/python" "$root/tests/cli/tests/$script" "$@"
