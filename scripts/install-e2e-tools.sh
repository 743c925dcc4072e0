#!/usr/bin/env bash
# Install what the e2e tier (tests/e2e, a real single-node cluster from e2e/cluster/) needs, idempotently:
#   Debian packages  docker.io (dockerd 20.10 + its client), containerd, runc, containernetworking-plugins
#                    (the CNI bridge), iptables, conntrack, socat, mmdebstrap (the Python base image), gcc and
#                    libc6-dev (the static pause binary), etcd-server, golang-1.19-go + reflect2 (the build)
#   binaries         kubelet, kube-controller-manager, kube-scheduler, kube-proxy, kubectl 1.20.2 from Debian's
#                    source by scripts/build-kube-node.sh (cached; ~5-7 min once); kube-apiserver comes from
#                    scripts/install-test-tools.sh (scripts/build-kube-apiserver.sh)
# No service is started: Debian's docker.io would start dockerd in the root namespace, so a policy-rc.d that
# refuses is in place while apt runs (and removed after, if this script made it).
# apt-get update runs only when a package is missing. Needs root when something is missing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PACKAGES=(docker.io containerd runc containernetworking-plugins iptables conntrack socat mmdebstrap
          gcc libc6-dev etcd-server golang-1.19-go golang-github-modern-go-reflect2-dev dpkg-dev)
export DEBIAN_FRONTEND=noninteractive
die() { echo "install-e2e-tools: ERROR: $*" >&2; exit 1; }
note() { echo "install-e2e-tools: $*" >&2; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}: run this script as root"
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# install-e2e-tools.sh: no service starts while it installs\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    made_policy=1
  fi
  note "apt-get install ${missing[*]}"
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
fi
NODE=$("$ROOT/scripts/build-kube-node.sh" | tail -n1) || die "building the node binaries failed"
echo "dockerd: $(/usr/sbin/dockerd --version)"
echo "kubelet: $NODE/kubelet ($("$NODE/kubelet" --version))"
