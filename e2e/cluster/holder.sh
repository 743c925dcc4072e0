#!/bin/sh
# The holder: PID of the cluster's private mount namespace. Started by up.sh already inside a new mount
# namespace (unshare --mount, slave propagation: the host's mounts are seen, ours never leave) and inside the
# cluster's network namespace. It makes the private mounts, then sleeps; every daemon joins it with
# `nsenter -t <holder> -m -n`, so they all share these mounts (kubelet's secret tmpfs volumes must be seen by
# dockerd). When the last process of the namespace exits, the namespace and all its mounts go with it.
#   holder.sh RUN NODE_IP
set -e
RUN=$1
NODE_IP=$2
mkdir -p "$RUN/mnt/cgroup" "$RUN/varlog" "$RUN/sysctl" "$RUN/var-lib-kubelet" "$RUN/opt-containerd" "$RUN/etc-docker"
# /run: dockershim's socket, /run/xtables.lock, the containerd shims' sockets (a fixed path), dnsmasq...
mount -t tmpfs -o mode=755 smg-e2e-run /run
# Paths the components hard-code: kubelet 1.20's device-plugins folder, containerd's opt plugin, dockerd's
# key.json, kubelet's /var/log/pods and /var/log/containers. up.sh made the mountpoints that were missing.
mount --bind "$RUN/var-lib-kubelet" /var/lib/kubelet
mount --bind "$RUN/opt-containerd" /opt/containerd
mount --bind "$RUN/etc-docker" /etc/docker
mount --bind "$RUN/varlog" /var/log
# A sysfs of this network namespace (so /sys/class/net lists only its interfaces) with the host's cgroup
# hierarchies bound back under it (`ip netns exec` would drop them).
mount --rbind /sys/fs/cgroup "$RUN/mnt/cgroup"
mount -t sysfs sysfs /sys
mount --rbind "$RUN/mnt/cgroup" /sys/fs/cgroup
umount -l "$RUN/mnt/cgroup"
# Name lookups fail at once, inside the namespace: no DNS query leaves it.
echo "nameserver $NODE_IP" >"$RUN/resolv.conf"
mount --bind "$RUN/resolv.conf" /etc/resolv.conf
# kubelet sets these global kernel settings when they differ from what it wants (vm.overcommit_memory=1,
# kernel.panic=10, ...). Show it its own values, so the host's stay as they are.
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
          kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  key=${kv%=*}
  file="$RUN/sysctl/$(echo "$key" | tr / _)"
  echo "${kv#*=}" >"$file"
  mount --bind "$file" "/proc/sys/$key"
done
echo ready >"$RUN/holder.ready"
exec sleep infinity
