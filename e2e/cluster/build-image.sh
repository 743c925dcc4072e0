#!/usr/bin/env bash
# Build SMG's image from the repository's Dockerfile into the e2e cluster's docker (the node's image store),
# offline: the namespace has no route out, so the wheels are made on the host (SMG's own with
# `pip wheel --no-deps`, its dependencies with `pip download` for the image's Python) into a ./wheelhouse
# of a copy of the build context, and `docker build --network none` installs only from there.
#   build-image.sh TAG      (the cluster must be up; BASE_IMAGE comes from up.sh)
# Prints the image's size in bytes last.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
TAG=${1:?usage: build-image.sh TAG}
REPO=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
BASE=${SMG_E2E_BASE_IMAGE:-smg-base:bookworm}
PYVER=$(dk run --rm --network none --entrypoint python3 "$BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
CTX=$RUN/image-context
rm -rf "$CTX"
mkdir -p "$CTX/wheelhouse"
cp "$REPO/Dockerfile" "$REPO/.dockerignore" "$REPO/pyproject.toml" "$REPO/README.md" "$CTX/"
for d in router sim operator; do
  cp -r "$REPO/$d" "$CTX/$d"
done
find "$CTX" \( -name __pycache__ -o -name '*.egg-info' -o -name .pytest_cache \) -prune -exec rm -rf {} +
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$CTX/wheelhouse" "$CTX" >&2
"$PY" -m pip download --quiet --dest "$CTX/wheelhouse" --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform linux_x86_64 \
  "$(ls "$CTX"/wheelhouse/smg_router_py-*.whl)" >&2
DOCKER_BUILDKIT=1 dk build --quiet --network none --build-arg "BASE_IMAGE=$BASE" -t "$TAG" "$CTX" >&2
# The data-root is kept across runs: drop the images this tag replaced and keep the build cache under 1 GB.
dk image prune --force >/dev/null
dk builder prune --force --keep-storage 1000000000 >/dev/null
dk image inspect "$TAG" --format '{{.Size}}'
