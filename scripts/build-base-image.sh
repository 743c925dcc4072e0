#!/usr/bin/env bash
# Make a Python base image for the Dockerfile's BASE_IMAGE from Debian packages, for machines that reach a
# Debian mirror but no container registry (python:3.11-slim cannot be pulled there):
#     scripts/build-base-image.sh [TAG]          # default TAG smg-base:bookworm
#     docker build --build-arg BASE_IMAGE=smg-base:bookworm -t smg:0.1.0 .
# mmdebstrap writes a minbase root filesystem of this machine's Debian release with python3, python3-venv
# and ca-certificates, from the machine's own apt sources; `docker import` turns it into an image. The
# filesystem tarball is cached (<cache>/images/, <cache> = ${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg})
# so a second import needs no mirror; the image itself is made only when the daemon lacks TAG.
#
# Environment: DOCKER (the docker command; may hold options, e.g. "docker -H unix:///path/docker.sock"),
# NICE (default 10). Needs root (mmdebstrap's root mode) and the mmdebstrap package.
set -euo pipefail

TAG=${1:-smg-base:bookworm}
DOCKER=${DOCKER:-docker}
NICE=${NICE:-10}
CACHE_ROOT=${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}
CODENAME=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
PACKAGES=python3,python3-venv,ca-certificates
TARBALL="$CACHE_ROOT/images/debian-$CODENAME-python3.tar"

log() { echo "build-base-image: $*" >&2; }
die() { echo "build-base-image: ERROR: $*" >&2; exit 1; }
[ -n "$CODENAME" ] || die "no VERSION_CODENAME in /etc/os-release"

# shellcheck disable=SC2086  # DOCKER may carry options
if $DOCKER image inspect "$TAG" >/dev/null 2>&1; then
  log "$TAG exists"
  echo "$TAG"
  exit 0
fi

if [ ! -s "$TARBALL" ]; then
  command -v mmdebstrap >/dev/null || die "mmdebstrap is missing (apt-get install mmdebstrap)"
  mkdir -p "$(dirname "$TARBALL")"
  # The machine's enabled deb entries of this release, as one-line sources on stdin (deb822 and .list).
  sources=$(python3 - "$CODENAME" <<'PY'
"""Print `deb URI SUITE COMPONENTS` for every enabled Debian entry of this release in /etc/apt."""
import glob
import re
import sys

codename = sys.argv[1]
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for block in re.split(r"\n\s*\n", open(path).read()):
        fields = {}
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("#") and ":" in line and line[0] not in " \t":
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                if suite == codename or suite.startswith(codename + "-"):
                    print("deb", uri, suite, fields.get("components", "main"))
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        continue
    for line in lines:
        m = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)$", line.split("#", 1)[0].strip())
        if m and (m.group(2) == codename or m.group(2).startswith(codename + "-")):
            print("deb", m.group(1), m.group(2), m.group(3) or "main")
PY
)
  [ -n "$sources" ] || die "no enabled Debian apt source for $CODENAME found"
  log "mmdebstrap $CODENAME minbase + $PACKAGES -> $TARBALL"
  # The name must end in .tar: mmdebstrap picks the output format from it.
  part="$TARBALL.part.$$.tar"
  had_utab_dir=0
  [ -d /run/mount ] && had_utab_dir=1   # libmount makes /run/mount for mmdebstrap's mounts; removed after if new
  nice -n "$NICE" mmdebstrap --quiet --format=tar --variant=minbase --include="$PACKAGES" \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$CODENAME" "$part" - <<<"$sources" || { rm -f "$part"; die "mmdebstrap failed"; }
  mv -f "$part" "$TARBALL"
  [ "$had_utab_dir" = 1 ] || rmdir /run/mount 2>/dev/null || true
fi

log "docker import $TARBALL as $TAG"
# shellcheck disable=SC2086
$DOCKER import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$TAG" <"$TARBALL" >/dev/null || die "docker import failed"
echo "$TAG"
