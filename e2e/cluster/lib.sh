# Settings and helpers of the e2e cluster, sourced by up.sh and down.sh (see README.md in this folder).
# Every path and name the cluster uses is here; nothing else in the project hard-codes them.
# shellcheck shell=bash
CACHE_ROOT=${SMG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smg}
KUBE_VERSION=1.20.2
APISERVER_BIN=${SMG_KUBE_APISERVER:-$CACHE_ROOT/kube-apiserver-$KUBE_VERSION/kube-apiserver}
NODE_BIN=$CACHE_ROOT/kube-node-$KUBE_VERSION     # kubelet, kube-controller-manager, kube-scheduler, kube-proxy, kubectl
STATE=${SMG_E2E_STATE:-$CACHE_ROOT/e2e-cluster}  # outside git; docker/ (the node's images) survives a run
RUN=$STATE/run                                   # this run's state (PKI, etcd, kubelet, logs), wiped by up.sh
LOGS=$RUN/logs
NETNS=${SMG_E2E_NETNS:-smg-e2e}                  # the network namespace everything lives in
NODE_IF=node0
NODE_IP=10.200.0.1                               # only inside $NETNS
NODE_NAME=smg-e2e-node
POD_CIDR=10.244.0.0/24
POD_GATEWAY=10.244.0.1
SVC_CIDR=10.96.0.0/24
API_PORT=6443
DOCKERD=/usr/sbin/dockerd
DOCKER_CLI=/usr/bin/docker                       # Debian's client, the daemon's version (not /usr/local/bin/docker)
DOCKER_SOCK=$RUN/docker.sock
PAUSE_IMAGE=k8s.gcr.io/pause:3.2                 # kubelet 1.20's default sandbox image name
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

log() { echo "e2e-cluster: [$(date +%T)] $*" >&2; }
die() { echo "e2e-cluster: ERROR: $*" >&2; exit 1; }
holder_pid() { cat "$RUN/holder.pid" 2>/dev/null; }
# run a command inside the cluster's network and mount namespaces
inside() { nsenter -t "$(holder_pid)" -m -n -- "$@"; }
kc() { inside "$NODE_BIN/kubectl" --kubeconfig "$RUN/pki/admin.kubeconfig" --cache-dir "$RUN/kube-cache" "$@"; }
dk() { inside env DOCKER_CONFIG="$RUN/docker-cli" "$DOCKER_CLI" -H "unix://$DOCKER_SOCK" "$@"; }
# start a daemon inside the namespaces, in its own session, niced; its PID goes to $RUN/<name>.pid
start_daemon() {
  local name=$1 i
  shift
  inside setsid sh -c 'echo $$ > "$0"; exec nice -n 5 "$@"' "$RUN/$name.pid" "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
  for i in $(seq 50); do [ -s "$RUN/$name.pid" ] && return 0; sleep 0.1; done
  die "$name did not start (log: $LOGS/$name.log)"
}
wait_for() {  # SECONDS WHAT COMMAND...
  local t=$1 what=$2 i
  shift 2
  for i in $(seq $((t * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  die "timed out after ${t}s waiting for $what"
}
