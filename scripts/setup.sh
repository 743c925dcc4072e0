#!/usr/bin/env bash
# Set up a fresh machine for SMG: a virtual environment in .venv with SMG and its test tools.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'
echo "setup: $(.venv/bin/python --version), smg installed in .venv"
