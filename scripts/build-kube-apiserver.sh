#!/usr/bin/env bash
# Build a real kube-apiserver from Debian's `kubernetes` source package (1.20.2) and cache it outside
# the work tree, keyed by version:
#     ${XDG_CACHE_HOME:-$HOME/.cache}/smg/kube-apiserver-1.20.2/kube-apiserver
# Builds only when that binary is absent (about 7 minutes measured on 2 cores, download included; up to
# ~11 reported; ~1.3 GB RAM at peak), so a second run returns at once. The last line printed is the binary's path.
#
# How the source is fetched: `apt-get source --download-only kubernetes` needs a deb-src entry. This
# script never edits the system's apt configuration: it derives a deb-src sources file from the machine's
# own Debian entries (same URIs, suites, components and keyrings; only `Types:` changes) and runs apt
# against that file with a private lists directory inside a temporary folder
# (-o Dir::Etc::SourceList / SourceParts / Dir::State::Lists), so nothing is left behind in /etc/apt or
# /var/lib/apt. The temporary folder (source, GOPATH, Go build cache) is removed after a successful build;
# after a failure it is kept for inspection and its path is printed (KEEP_BUILD_DIR=1 keeps it always).
#
# Environment: KUBE_APISERVER_VERSION (default 1.20.2; must be what Debian's source package holds),
# SMG_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/smg), TMPDIR.
set -euo pipefail

VERSION=${KUBE_APISERVER_VERSION:-1.20.2}
CACHE_ROOT=${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}
OUT_DIR="$CACHE_ROOT/kube-apiserver-$VERSION"
BIN="$OUT_DIR/kube-apiserver"
GO_PKG=golang-1.19-go
GO_ROOT=/usr/lib/go-1.19
BUILD_DEPS=("$GO_PKG" golang-github-modern-go-reflect2-dev dpkg-dev)

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

log() { echo "build-kube-apiserver: $*" >&2; }
die() { echo "build-kube-apiserver: ERROR: $*" >&2; exit 1; }

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  log "cached: $("$BIN" --version)"
  echo "$BIN"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive

# --- build dependencies (apt-get update only when something is missing) -------------------------------
missing=()
for p in "${BUILD_DEPS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}: install them (apt-get) or run this script as root"
  log "installing ${missing[*]}"
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
fi
[ -x "$GO_ROOT/bin/go" ] || die "$GO_ROOT/bin/go not found after installing $GO_PKG"
REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
[ -d "$REFLECT2" ] || die "$REFLECT2 not found (package golang-github-modern-go-reflect2-dev)"

START=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/smg-kube-apiserver-build.XXXXXX")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
case "$(cd "$WORK" && pwd -P)/" in "$ROOT"/*) rmdir "$WORK"; die "refusing to build inside the work tree ($WORK): set TMPDIR elsewhere";; esac
ok=0
cleanup() {
  if [ "$ok" = 1 ] && [ "${KEEP_BUILD_DIR:-0}" != 1 ]; then
    chmod -R u+w "$WORK" 2>/dev/null || true   # the Go module/build caches are read-only
    rm -rf "$WORK"
  else
    log "build folder kept for inspection: $WORK"
  fi
}
trap cleanup EXIT
log "building kube-apiserver $VERSION in $WORK"

# --- a private deb-src sources file derived from the machine's Debian entries ------------------------
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/parts" "$WORK/src"
python3 "$SCRIPTS/deb-src-sources.py" "$WORK/apt/src.sources" || die "could not derive a deb-src entry from /etc/apt sources"
APT_OPTS=(
  -o "Dir::Etc::SourceList=$WORK/apt/src.sources"
  -o "Dir::Etc::SourceParts=$WORK/apt/parts"
  -o "Dir::State::Lists=$WORK/apt/lists"
  -o "Dir::Cache::pkgcache="
  -o "Dir::Cache::srcpkgcache="
  -o "APT::Get::List-Cleanup=0"
  -o "APT::Sandbox::User=root"
)
log "deb-src entries: $(grep -c '^Types' "$WORK/apt/src.sources") (derived from the machine's sources)"
apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update of the deb-src lists failed"
(cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only -qq kubernetes) \
  || die "apt-get source --download-only kubernetes failed"
DSC=$(ls "$WORK"/src/kubernetes_*.dsc 2>/dev/null | head -n1)
[ -n "$DSC" ] || die "no kubernetes .dsc downloaded"
(cd "$WORK/src" && dpkg-source --no-check -x "$DSC" tree >/dev/null) || die "dpkg-source -x $DSC failed"
TREE="$WORK/src/tree"
[ -f "$TREE/cmd/kube-apiserver/apiserver.go" ] || die "unexpected source layout in $TREE"
head -n1 "$TREE/debian/changelog" | grep -q -e "really$VERSION" -e "($VERSION-" \
  || log "warning: could not confirm the source is v$VERSION ($(head -n1 "$TREE/debian/changelog"))"

# --- GOPATH-mode build -----------------------------------------------------------------------------
export GOPATH="$WORK/gopath" GOCACHE="$WORK/gocache" GO111MODULE=off GOFLAGS= GOTOOLCHAIN=local CGO_ENABLED=0
export PATH="$GO_ROOT/bin:$PATH"
mkdir -p "$GOPATH/src/k8s.io" "$GOCACHE"
ln -s "$TREE" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"

# reflect2 1.0.1 (vendored) breaks on Go >= 1.18; Debian's 1.0.2 replaces it.
rm -rf vendor/github.com/modern-go/reflect2
cp -r "$REFLECT2" vendor/github.com/modern-go/reflect2
rm -rf vendor/github.com/modern-go/reflect2/.git* vendor/github.com/modern-go/reflect2/*_test.go 2>/dev/null || true

# The tarball lacks pkg/generated/openapi/zz_generated.openapi.go: generate it like Makefile.generated_files.
log "building openapi-gen and generating pkg/generated/openapi"
go build -o "$WORK/openapi-gen" k8s.io/kubernetes/vendor/k8s.io/kube-openapi/cmd/openapi-gen || die "building openapi-gen failed"
# Like hack/make-rules/helpers/cache_go_dirs.sh + Makefile.generated_files: every Go file of the tree
# outside ./vendor (staging/src named as its vendor/ twin) with a `// +k8s:` tag and `+k8s:openapi-gen=`,
# minus code-generator and sample-apiserver; their folders become k8s.io/kubernetes/... packages.
INPUTS=$(find -H . \( -path './_*' -o -path './.*' -o -path ./vendor -o -path ./debian \) -prune \
           -o -type f -name '*.go' -print \
  | sed -e 's|^\./staging/src|vendor|' -e 's|^\./||' \
  | grep -v -e '^vendor/k8s.io/code-generator/' -e '^vendor/k8s.io/sample-apiserver/' \
  | xargs grep -l '^// *+k8s:' | xargs grep -l '+k8s:openapi-gen=' \
  | xargs -n1 dirname | LC_ALL=C sort -u | sed 's|^|k8s.io/kubernetes/|' | paste -sd, -)
[ -n "$INPUTS" ] || die "no packages tagged +k8s:openapi-gen= found"
BOILER=vendor/k8s.io/code-generator/hack/boilerplate.go.txt
[ -f "$BOILER" ] || { BOILER="$WORK/boilerplate.go.txt"; : > "$BOILER"; }
rm -f pkg/generated/openapi/zz_generated.openapi.go
"$WORK/openapi-gen" --logtostderr -v 1 \
  -i "$INPUTS" \
  -p k8s.io/kubernetes/pkg/generated/openapi \
  -O zz_generated.openapi \
  -h "$BOILER" \
  -r "$WORK/openapi-violations.report" >"$WORK/openapi-gen.log" 2>&1 \
  || { tail -n 30 "$WORK/openapi-gen.log" >&2; die "openapi-gen failed"; }
[ -s pkg/generated/openapi/zz_generated.openapi.go ] || die "openapi-gen produced no zz_generated.openapi.go"

log "go build k8s.io/kubernetes/cmd/kube-apiserver (the long part)"
MINOR=$(echo "$VERSION" | cut -d. -f2)
LDFLAGS="-s -w"
for v in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  LDFLAGS+=" -X k8s.io/kubernetes/vendor/$v.gitVersion=v$VERSION -X k8s.io/kubernetes/vendor/$v.gitMajor=1"
  LDFLAGS+=" -X k8s.io/kubernetes/vendor/$v.gitMinor=$MINOR -X k8s.io/kubernetes/vendor/$v.gitTreeState=archive"
done
go build -ldflags "$LDFLAGS" -o "$WORK/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver \
  || die "go build kube-apiserver failed"
"$WORK/kube-apiserver" --version >/dev/null 2>&1 || die "the built kube-apiserver does not run"

mkdir -p "$OUT_DIR"
install -m 0755 "$WORK/kube-apiserver" "$BIN.tmp.$$"
mv -f "$BIN.tmp.$$" "$BIN"
ok=1
log "built $("$BIN" --version) in $(( $(date +%s) - START )) s"
echo "$BIN"
