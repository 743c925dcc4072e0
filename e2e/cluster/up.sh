#!/usr/bin/env bash
# Bring up a single-node Kubernetes 1.20 cluster inside a network namespace of its own, and wait until the
# node is Ready. Prints the path of a kubeconfig for the root namespace last (its API address is a loopback
# forwarder, 127.0.0.1 only). down.sh undoes everything; up.sh runs it first to clear what a killed run left.
# Needs root and the tools of scripts/install-e2e-tools.sh. See README.md in this folder.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ "$(id -u)" = 0 ] || die "needs root (network and mount namespaces, dockerd, kubelet)"
for b in "$APISERVER_BIN" "$NODE_BIN/kubelet" "$NODE_BIN/kube-controller-manager" "$NODE_BIN/kube-scheduler" \
         "$NODE_BIN/kube-proxy" "$NODE_BIN/kubectl" "$DOCKERD" "$DOCKER_CLI" /usr/bin/etcd /usr/lib/cni/bridge \
         /usr/bin/socat /usr/bin/openssl /usr/bin/gcc /usr/bin/mmdebstrap; do
  [ -x "$b" ] || die "$b is missing: run scripts/install-e2e-tools.sh (as root)"
done
T0=$(date +%s)
step() { log "+$(( $(date +%s) - T0 ))s $*"; }
"$HERE/down.sh" >/dev/null 2>&1 || true
rm -rf "$RUN"
mkdir -p "$RUN" "$LOGS" "$STATE/docker" "$STATE/marks"
MARKS=$STATE/marks   # what up.sh created in the root namespace, so that down.sh removes only that

# --- the network namespace: lo + a veth pair with both ends inside; the node IP on one end ------------------
# No link to the root namespace: the default route is a dead end (the peer has no address), nothing leaves.
[ -d /run/netns ] || touch "$MARKS/run-netns"
[ -d /run/mount ] || touch "$MARKS/run-mount"
for p in /var/lib/kubelet /opt/containerd /etc/docker; do
  [ -d "$p" ] || { mkdir -p "$p"; touch "$MARKS/dir$(echo "$p" | tr / _)"; }
done
for top in kubepods docker; do
  [ -d "/sys/fs/cgroup/memory/$top" ] || [ -d "/sys/fs/cgroup/$top" ] || touch "$MARKS/cgroup-$top"
done
ip netns add "$NETNS"
ip -n "$NETNS" link set lo up
ip -n "$NETNS" link add "$NODE_IF" type veth peer name "$NODE_IF-sink"
ip -n "$NETNS" addr add "$NODE_IP/24" dev "$NODE_IF"
ip -n "$NETNS" link set "$NODE_IF-sink" up
ip -n "$NETNS" link set "$NODE_IF" up
ip -n "$NETNS" route add default dev "$NODE_IF"
ip netns exec "$NETNS" sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 \
  net.bridge.bridge-nf-call-ip6tables=1 net.ipv4.conf.all.route_localnet=1
setsid unshare --mount --propagation slave -- nsenter --net="/run/netns/$NETNS" -- \
  /bin/sh "$HERE/holder.sh" "$RUN" "$NODE_IP" </dev/null >"$LOGS/holder.log" 2>&1 &
echo $! >"$RUN/holder.pid"
wait_for 10 "the holder's mounts" test -f "$RUN/holder.ready"
step "network namespace $NETNS, holder $(holder_pid)"

# --- dockerd: its own data-root (kept across runs: the images), no bridge, no iptables, cgroupfs --------------
echo '{}' >"$RUN/dockerd.json"
start_daemon dockerd "$DOCKERD" --config-file "$RUN/dockerd.json" -H "unix://$DOCKER_SOCK" \
  --data-root "$STATE/docker" --exec-root "$RUN/docker-exec" --pidfile "$RUN/dockerd.pidfile" \
  --exec-opt native.cgroupdriver=cgroupfs --storage-driver overlay2 --log-driver json-file \
  --bridge=none --iptables=false --ip-masq=false --ip-forward=false --userland-proxy=false
wait_for 60 dockerd dk version
step "dockerd $(dk version --format '{{.Server.Version}}')"

# --- images that cannot be pulled: the sandbox (pause) and the Python base ----------------------------------
if ! dk image inspect "$PAUSE_IMAGE" >/dev/null 2>&1; then
  mkdir -p "$RUN/pause"
  gcc -Os -Wall -Werror -static -o "$RUN/pause/pause" "$HERE/pause.c"
  strip "$RUN/pause/pause"
  tar -C "$RUN/pause" -c pause | dk import --change 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
fi
DOCKER="nsenter -t $(holder_pid) -m -n -- env DOCKER_CONFIG=$RUN/docker-cli $DOCKER_CLI -H unix://$DOCKER_SOCK" \
  "$HERE/../../scripts/build-base-image.sh" "${SMG_E2E_BASE_IMAGE:-smg-base:bookworm}" >/dev/null
step "images $PAUSE_IMAGE, ${SMG_E2E_BASE_IMAGE:-smg-base:bookworm}"

# --- PKI (openssl): a CA, the API server's certificate, one client certificate + kubeconfig per component ----
P=$RUN/pki
mkdir -p "$P"
(
  cd "$P"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 7 -subj /CN=smg-e2e-ca 2>/dev/null
  printf 'subjectAltName=DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:10.96.0.1,IP:%s,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' "$NODE_IP" >server.ext
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 -extfile server.ext \
    -out apiserver.crt 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >client.ext
  client() {  # NAME CN [O]: NAME.crt/.key and NAME.kubeconfig (written directly: no kubectl config calls)
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2${3:+/O=$3}" 2>/dev/null
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 -extfile client.ext \
      -out "$1.crt" 2>/dev/null
    cat >"$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: smg-e2e
  cluster:
    server: https://$NODE_IP:$API_PORT
    certificate-authority-data: $(base64 -w0 ca.crt)
users:
- name: $1
  user:
    client-certificate-data: $(base64 -w0 "$1.crt")
    client-key-data: $(base64 -w0 "$1.key")
contexts:
- name: smg-e2e
  context: {cluster: smg-e2e, user: $1}
current-context: smg-e2e
KC
  }
  client admin smg-e2e-admin system:masters
  client kubelet "system:node:$NODE_NAME" system:nodes
  client controller-manager system:kube-controller-manager
  client scheduler system:kube-scheduler
  client kube-proxy system:kube-proxy
  client apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  rm -f ./*.csr ./*.ext
)

# --- control plane: etcd (the namespace's own loopback), API server, controller-manager, scheduler ---------
start_daemon etcd /usr/bin/etcd --name smg-e2e --data-dir "$RUN/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster smg-e2e=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381
wait_for 30 etcd inside curl -sf http://127.0.0.1:2379/health
start_daemon kube-apiserver "$APISERVER_BIN" --etcd-servers=http://127.0.0.1:2379 \
  --bind-address="$NODE_IP" --secure-port="$API_PORT" --insecure-port=0 --advertise-address="$NODE_IP" \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" --kubelet-client-key="$P/apiserver-kubelet-client.key" \
  --kubelet-preferred-address-types=InternalIP \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range="$SVC_CIDR" --allow-privileged=true --profiling=false
wait_for 90 kube-apiserver inside curl -sf --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
  "https://$NODE_IP:$API_PORT/readyz"
start_daemon kube-controller-manager "$NODE_BIN/kube-controller-manager" \
  --kubeconfig="$P/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$P/controller-manager.kubeconfig" --authorization-kubeconfig="$P/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 --port=0 --leader-elect=false --cluster-name=smg-e2e \
  --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" --use-service-account-credentials=true \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" --profiling=false \
  --flex-volume-plugin-dir="$RUN/flexvolume"
start_daemon kube-scheduler "$NODE_BIN/kube-scheduler" --kubeconfig="$P/scheduler.kubeconfig" \
  --authentication-kubeconfig="$P/scheduler.kubeconfig" --authorization-kubeconfig="$P/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --port=0 --leader-elect=false --profiling=false
step "control plane"

# --- the node: kubelet (dockershim on our dockerd, CNI bridge) and kube-proxy (iptables, this namespace) -----
K=$RUN/kubelet
mkdir -p "$K/pki" "$K/volume-plugins" "$RUN/dockershim" "$RUN/cni/cache" "$RUN/cni/networks" "$RUN/cni/conf"
cat >"$RUN/cni/conf/10-smg-e2e.conflist" <<CNI
{
  "cniVersion": "0.4.0",
  "name": "smg-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$RUN/cni/networks",
              "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GATEWAY"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
CNI
start_daemon kubelet "$NODE_BIN/kubelet" \
  --kubeconfig="$P/kubelet.kubeconfig" --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
  --container-runtime=docker --docker-endpoint="unix://$DOCKER_SOCK" \
  --pod-infra-container-image="$PAUSE_IMAGE" --experimental-dockershim-root-directory="$RUN/dockershim" \
  --network-plugin=cni --cni-conf-dir="$RUN/cni/conf" --cni-bin-dir=/usr/lib/cni --cni-cache-dir="$RUN/cni/cache" \
  --cgroup-driver=cgroupfs --fail-swap-on=false \
  --root-dir="$K" --cert-dir="$K/pki" --volume-plugin-dir="$K/volume-plugins" \
  --address="$NODE_IP" --port=10250 --read-only-port=0 --healthz-bind-address=127.0.0.1 \
  --anonymous-auth=false --client-ca-file="$P/ca.crt" --authorization-mode=Webhook \
  --eviction-hard='memory.available<100Mi,nodefs.available<1%,imagefs.available<1%' \
  --image-gc-high-threshold=100 --image-gc-low-threshold=99 --node-status-update-frequency=4s --v=1
start_daemon kube-proxy "$NODE_BIN/kube-proxy" --kubeconfig="$P/kube-proxy.kubeconfig" \
  --hostname-override="$NODE_NAME" --bind-address="$NODE_IP" --cluster-cidr="$POD_CIDR" --proxy-mode=iptables \
  --conntrack-max-per-core=0 --conntrack-min=0 \
  --conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0 \
  --healthz-bind-address=127.0.0.1:10256 --metrics-bind-address=127.0.0.1:10249 --v=1

# --- the API server on the root namespace's loopback: socat, one nsenter'd socat per connection --------------
LOCAL_PORT=${SMG_E2E_API_LOCAL_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
printf '#!/bin/sh\nexec nsenter --net=/run/netns/%s socat STDIO TCP:%s:%s\n' "$NETNS" "$NODE_IP" "$API_PORT" >"$RUN/api-conn.sh"
chmod +x "$RUN/api-conn.sh"
setsid sh -c 'echo $$ > "$0"; exec socat TCP-LISTEN:"$1",bind=127.0.0.1,reuseaddr,fork EXEC:"$2"' \
  "$RUN/api-forward.pid" "$LOCAL_PORT" "$RUN/api-conn.sh" </dev/null >"$LOGS/api-forward.log" 2>&1 &
sed "s#https://$NODE_IP:$API_PORT#https://127.0.0.1:$LOCAL_PORT#" "$P/admin.kubeconfig" >"$RUN/kubeconfig"
wait_for 10 "the API forwarder" test -s "$RUN/api-forward.pid"

node_ready() { kc get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' | grep -qx True; }
wait_for 180 "node $NODE_NAME Ready" node_ready
sa_token() { kc get serviceaccount default -o 'jsonpath={.secrets[0].name}' | grep -q .; }
wait_for 60 "the default ServiceAccount's token" sa_token
step "node $NODE_NAME Ready; API on https://127.0.0.1:$LOCAL_PORT"
cat >"$RUN/cluster.env" <<ENV
NETNS=$NETNS
HOLDER_PID=$(holder_pid)
DOCKER_SOCK=$DOCKER_SOCK
DOCKER_CLI=$DOCKER_CLI
KUBECTL=$NODE_BIN/kubectl
KUBECONFIG_INSIDE=$P/admin.kubeconfig
API_LOCAL_PORT=$LOCAL_PORT
ENV
echo "$RUN/kubeconfig"
