"""The real kube-apiserver tier: one etcd + kube-apiserver on loopback per session (see support/kube.py)."""

from support.kube_fixtures import control_plane  # noqa: F401
