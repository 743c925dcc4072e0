#!/usr/bin/env bash
# Stop everything up.sh started, by PID, and leave the root namespace as it was: the daemons in reverse
# order, the pods' containers, whatever still lives in the cluster's mount namespace (containerd shims), the
# holder, the network namespace, and the mountpoints, folders and cgroups that up.sh's marks say it created.
# The node's images (the docker data-root under $STATE/docker) stay for the next run.
# Prints one line that counts what is left (all zeros after a clean teardown).
set -uo pipefail
. "$(dirname "$0")/lib.sh"
MARKS=$STATE/marks
stop_pid() {  # NAME [SECONDS]: SIGTERM the PID in $RUN/NAME.pid, SIGKILL after SECONDS (default 15)
  local f=$RUN/$1.pid p i
  [ -s "$f" ] || return 0
  p=$(cat "$f")
  if kill -0 "$p" 2>/dev/null; then
    kill "$p"
    for i in $(seq $((${2:-15} * 5))); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$p" 2>/dev/null && { log "SIGKILL $1 ($p)"; kill -9 "$p"; }
  fi
  rm -f "$f"
}
if [ -s "$RUN/api-forward.pid" ]; then   # the loopback forwarder and its per-connection children
  fp=$(cat "$RUN/api-forward.pid")
  kids=$(pgrep -P "$fp" || true)
  stop_pid api-forward 5
  for c in $kids; do kill "$c" 2>/dev/null || true; done
fi
H=$(holder_pid || true)
if [ -n "$H" ] && kill -0 "$H" 2>/dev/null; then
  stop_pid kube-proxy
  stop_pid kubelet
  if [ -S "$DOCKER_SOCK" ]; then
    ids=$(dk ps -aq 2>/dev/null)
    [ -n "$ids" ] && dk rm -f $ids >/dev/null 2>&1
  fi
  stop_pid kube-scheduler
  stop_pid kube-controller-manager
  stop_pid kube-apiserver
  stop_pid etcd
  stop_pid dockerd 30
  MNT=$(readlink "/proc/$H/ns/mnt")
  for d in /proc/[0-9]*; do   # what is left in our mount namespace (containerd-shims, strays), by PID
    p=${d#/proc/}
    [ "$p" = "$H" ] && continue
    if [ "$(readlink "$d/ns/mnt" 2>/dev/null)" = "$MNT" ]; then
      log "killing leftover $p: $(tr '\0' ' ' <"$d/cmdline" 2>/dev/null | cut -c1-80)"
      kill -9 "$p" 2>/dev/null
    fi
  done
  kill "$H" 2>/dev/null
  for i in $(seq 25); do kill -0 "$H" 2>/dev/null || break; sleep 0.2; done
fi
rm -f "$RUN/holder.pid" "$RUN/holder.ready"
ip netns list 2>/dev/null | grep -qw "^$NETNS" && ip netns del "$NETNS"
if [ -d "$MARKS" ]; then
  for m in "$MARKS"/dir_*; do
    [ -e "$m" ] || continue
    p=$(basename "$m" | sed 's/^dir//; s#_#/#g')
    rmdir "$p" 2>/dev/null && rm -f "$m"
  done
  if [ -e "$MARKS/run-netns" ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ]; then   # ip netns' own mount
    umount /run/netns 2>/dev/null
    rmdir /run/netns 2>/dev/null && rm -f "$MARKS/run-netns"
  fi
  [ -e "$MARKS/run-mount" ] && rm -rf /run/mount && rm -f "$MARKS/run-mount"   # libmount's utab
  for top in kubepods docker; do   # the cgroups kubelet and dockerd made in each hierarchy
    [ -e "$MARKS/cgroup-$top" ] || continue
    for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
      [ -d "$h$top" ] && find "$h$top" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
    rm -f "$MARKS/cgroup-$top"
  done
fi
left_netns=$(ip netns list 2>/dev/null | grep -cw "^$NETNS")
left_mounts=$(grep -c " $STATE" /proc/self/mountinfo)
echo "e2e-cluster down: netns=$left_netns mounts=$left_mounts"
