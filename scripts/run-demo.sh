#!/usr/bin/env bash
# Set up, then run SMG on its embedded default: the router on port 30000 in front of a simulated
# fleet of three smg-sim workers (127.0.0.2-4:8000).  Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/smg-demo "$@"
