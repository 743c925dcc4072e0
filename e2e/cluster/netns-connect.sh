#!/bin/sh
# One connection into the cluster's network namespace: stdin/stdout to ADDRESS:PORT there (a socat per
# connection; Cluster.connect in tests/support/e2e_cluster.py forwards a loopback port through it).
#   netns-connect.sh NETNS ADDRESS PORT
exec nsenter --net="/run/netns/$1" socat STDIO "TCP:$2:$3"
