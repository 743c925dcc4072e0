#!/usr/bin/env bash
# Build the node and controller binaries of the e2e cluster (e2e/cluster) from Debian's `kubernetes`
# source package (1.20.2), the same tree scripts/build-kube-apiserver.sh builds the API server from, and
# cache them outside the work tree, keyed by version:
#     ${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}/kube-node-1.20.2/{kubelet,kube-controller-manager,
#                                                                      kube-scheduler,kube-proxy,kubectl}
# Builds only when one of them is absent (one `go build` of all five: about 5-7 minutes on 2 cores, cold), so
# a second run returns at once. The last line printed is the folder.
#
# kubectl is built too: Debian's kubectl 1.20.2 binary carries the vendored reflect2 1.0.1, which panics under
# Go >= 1.18 in some commands; this build swaps in Debian's reflect2 1.0.2 as the API server's build does.
#
# One source patch, for machines whose capability bounding set lacks CAP_SYS_RESOURCE (containers and VMs
# that drop it): no process there may lower an oom_score_adj below 0, so runc dies with "can't get final
# child's PID from pipe: EOF" for every pod sandbox (dockershim asks for -998) and every Guaranteed container
# (-997). The patch clamps both at 0 in kubelet's dockershim; Burstable and BestEffort scores are unchanged.
#
# Like build-kube-apiserver.sh, the system's apt configuration is never edited (a private deb-src sources
# file, from scripts/deb-src-sources.py, and a private lists folder), and the temporary folder is removed
# after a successful build (kept after a failure, or always with KEEP_BUILD_DIR=1).
#
# Environment: KUBE_VERSION (default 1.20.2), SMG_CACHE_DIR, TMPDIR; NICE (default 19) for the compiler.
set -euo pipefail

VERSION=${KUBE_VERSION:-1.20.2}
CACHE_ROOT=${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}
OUT_DIR="$CACHE_ROOT/kube-node-$VERSION"
NAMES=(kubelet kube-controller-manager kube-scheduler kube-proxy kubectl)
GO_PKG=golang-1.19-go
GO_ROOT=/usr/lib/go-1.19
BUILD_DEPS=("$GO_PKG" golang-github-modern-go-reflect2-dev dpkg-dev)
NICE=${NICE:-19}
SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

log() { echo "build-kube-node: $*" >&2; }
die() { echo "build-kube-node: ERROR: $*" >&2; exit 1; }

all_built() {
  local n
  for n in "${NAMES[@]}"; do [ -x "$OUT_DIR/$n" ] || return 1; done
  "$OUT_DIR/kubelet" --version >/dev/null 2>&1
}
if all_built; then
  log "cached: $("$OUT_DIR/kubelet" --version) in $OUT_DIR"
  echo "$OUT_DIR"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
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
WORK=$(mktemp -d "${TMPDIR:-/tmp}/smg-kube-node-build.XXXXXX")
ROOT=$(cd "$SCRIPTS/.." && pwd -P)
case "$(cd "$WORK" && pwd -P)/" in "$ROOT"/*) rmdir "$WORK"; die "refusing to build inside the work tree ($WORK): set TMPDIR elsewhere";; esac
ok=0
cleanup() {
  if [ "$ok" = 1 ] && [ "${KEEP_BUILD_DIR:-0}" != 1 ]; then
    chmod -R u+w "$WORK" 2>/dev/null || true   # the Go build cache is read-only
    rm -rf "$WORK"
  else
    log "build folder kept for inspection: $WORK"
  fi
}
trap cleanup EXIT
log "building ${NAMES[*]} $VERSION in $WORK"

# --- the source package, through a private deb-src sources file --------------------------------------
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
apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update of the deb-src lists failed"
(cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only -qq kubernetes) \
  || die "apt-get source --download-only kubernetes failed"
DSC=$(ls "$WORK"/src/kubernetes_*.dsc 2>/dev/null | head -n1)
[ -n "$DSC" ] || die "no kubernetes .dsc downloaded"
(cd "$WORK/src" && dpkg-source --no-check -x "$DSC" tree >/dev/null) || die "dpkg-source -x $DSC failed"
TREE="$WORK/src/tree"
[ -f "$TREE/cmd/kubelet/kubelet.go" ] || die "unexpected source layout in $TREE"

# --- the OOM-score patch (see the header) --------------------------------------------------------------
SANDBOX="$TREE/pkg/kubelet/dockershim/docker_sandbox.go"
HELPERS="$TREE/pkg/kubelet/dockershim/helpers_linux.go"
sed -i 's/^\tdefaultSandboxOOMAdj int = -998$/\tdefaultSandboxOOMAdj int = 0 \/\/ smg: was -998, needs CAP_SYS_RESOURCE/' "$SANDBOX"
sed -i 's/^\t\t\tcreateConfig.HostConfig.OomScoreAdj = int(rOpts.OomScoreAdj)$/\t\t\tif rOpts.OomScoreAdj > 0 { createConfig.HostConfig.OomScoreAdj = int(rOpts.OomScoreAdj) } \/\/ smg: no negative score/' "$HELPERS"
grep -q 'smg: was -998' "$SANDBOX" && grep -q 'smg: no negative score' "$HELPERS" \
  || die "the dockershim OOM-score patch did not apply (source changed?)"

# --- GOPATH-mode build -----------------------------------------------------------------------------
export GOPATH="$WORK/gopath" GOCACHE="$WORK/gocache" GO111MODULE=off GOFLAGS= GOTOOLCHAIN=local CGO_ENABLED=0 GOPROXY=off
export PATH="$GO_ROOT/bin:$PATH"
mkdir -p "$GOPATH/src/k8s.io" "$GOCACHE"
ln -s "$TREE" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"
rm -rf vendor/github.com/modern-go/reflect2
cp -r "$REFLECT2" vendor/github.com/modern-go/reflect2
rm -rf vendor/github.com/modern-go/reflect2/.git* vendor/github.com/modern-go/reflect2/*_test.go 2>/dev/null || true

# The tarball lacks pkg/generated/openapi/zz_generated.openapi.go (the controller-manager needs it).
log "building openapi-gen and generating pkg/generated/openapi"
nice -n "$NICE" go build -o "$WORK/openapi-gen" k8s.io/kubernetes/vendor/k8s.io/kube-openapi/cmd/openapi-gen \
  || die "building openapi-gen failed"
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
nice -n "$NICE" "$WORK/openapi-gen" --logtostderr -v 1 -i "$INPUTS" -p k8s.io/kubernetes/pkg/generated/openapi \
  -O zz_generated.openapi -h "$BOILER" -r "$WORK/openapi-violations.report" >"$WORK/openapi-gen.log" 2>&1 \
  || { tail -n 30 "$WORK/openapi-gen.log" >&2; die "openapi-gen failed"; }
[ -s pkg/generated/openapi/zz_generated.openapi.go ] || die "openapi-gen produced no zz_generated.openapi.go"

MINOR=$(echo "$VERSION" | cut -d. -f2)
LDFLAGS="-s -w"
for v in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  LDFLAGS+=" -X k8s.io/kubernetes/vendor/$v.gitVersion=v$VERSION -X k8s.io/kubernetes/vendor/$v.gitMajor=1"
  LDFLAGS+=" -X k8s.io/kubernetes/vendor/$v.gitMinor=$MINOR -X k8s.io/kubernetes/vendor/$v.gitTreeState=archive"
done
PKGS=()
for n in "${NAMES[@]}"; do PKGS+=("k8s.io/kubernetes/cmd/$n"); done
mkdir -p "$WORK/out"
log "go build ${NAMES[*]} (the long part, nice $NICE)"
nice -n "$NICE" go build -p 2 -ldflags "$LDFLAGS" -o "$WORK/out/" "${PKGS[@]}" || die "go build failed"
for n in "${NAMES[@]}"; do
  [ -x "$WORK/out/$n" ] || die "go build produced no $n"
done
"$WORK/out/kubelet" --version >/dev/null 2>&1 || die "the built kubelet does not run"

mkdir -p "$OUT_DIR"
for n in "${NAMES[@]}"; do
  install -m 0755 "$WORK/out/$n" "$OUT_DIR/$n.tmp.$$"
  mv -f "$OUT_DIR/$n.tmp.$$" "$OUT_DIR/$n"
done
ok=1
log "built ${NAMES[*]} ($("$OUT_DIR/kubelet" --version)) in $(( $(date +%s) - START )) s"
echo "$OUT_DIR"
