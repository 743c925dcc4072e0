#!/usr/bin/env bash
# Set up, then run the whole test suite (every tier that runs on this machine).
# Fails when pytest fails or collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/install-test-tools.sh   # etcd, prometheus, kubectl, kube-apiserver (built once, cached)
if [ "$(id -u)" = 0 ]; then         # the e2e tier's cluster (tests/e2e) needs root; without it the tier skips
  nice -n 19 ./scripts/install-e2e-tools.sh   # docker.io, CNI, mmdebstrap...; kubelet & co. (built once, cached)
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .     # one formatting, by the tool
.venv/bin/lint-imports --no-cache   # the layer contracts of pyproject.toml [tool.importlinter]
.venv/bin/mypy                      # --strict over router, operator and sim (pyproject.toml [tool.mypy])
set +e
.venv/bin/python -m pytest -p no:cacheprovider -rs "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no test: failing" >&2
  exit 1
fi
exit "$status"
