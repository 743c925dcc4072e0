"""The e2e suite's one seam to a Kubernetes cluster: whichever way the cluster comes, the tests get a ``Cluster``.

``provide_cluster`` picks, in this order:

1. ``SMG_E2E_KUBECONFIG=/path``: an existing cluster, used as it is (never created or deleted).  Its nodes must
   already hold the image named by ``SMG_E2E_IMAGE`` (default ``smg:e2e``), or be able to pull it.
2. ``kind`` on PATH: a kind cluster ``smg-e2e`` (created, and deleted at the end unless it existed); the image
   is built with ``docker build`` and loaded with ``kind load docker-image``.
3. Otherwise the project's own single-node cluster (``e2e/cluster/``), inside a network and mount namespace
   created for this run and torn down at the end; needs root.  ``SMG_E2E_BACKEND=namespace`` forces it.

Traffic to Services and pods goes through ``Cluster.connect``: with the project's cluster, a loopback
forwarder into the namespace that connects to the ClusterIP (so kube-proxy picks a ready endpoint for every
connection, as in-cluster clients see it); elsewhere ``kubectl port-forward``.  Only 127.0.0.1 and addresses
inside our own namespace ever receive traffic.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.procs import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPTS = REPO / "e2e" / "cluster"
DEFAULT_IMAGE = "smg:e2e"
KIND_NAME = "smg-e2e"


class Unavailable(Exception):
    """This machine cannot provide a cluster; the message says why (the suite skips with it)."""


def _run(args: list[str], *, timeout: float = 120, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{output}")
    return proc.stdout


@dataclass
class Forward:
    """A process that makes a target reachable on 127.0.0.1:port, stopped by PID."""

    url: str
    popen: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)


@dataclass
class Cluster:
    """A cluster the suite runs against: its kubeconfig, a kubectl, and how traffic reaches it."""

    backend: str  # "namespace" | "kind" | "kubeconfig"
    kubeconfig: Path
    kubectl_bin: str
    image: str
    netns: str | None = None  # the namespace backend's network namespace
    holder_pid: int | None = None  # the namespace backend's mount-namespace holder
    build_image: Callable[[str], int] | None = None  # tag -> image size in bytes
    figures: dict[str, Any] = field(default_factory=dict)

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True) -> str:
        return _run(
            [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args], input=input, timeout=timeout, check=check
        )

    def in_netns(self, args: list[str]) -> list[str]:
        """``args`` run inside the cluster's network namespace (namespace backend only)."""
        assert self.netns, f"the {self.backend} backend has no network namespace of ours"
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *args]

    def _target_ip(self, namespace: str, target: str) -> str:
        kind, _, name = target.partition("/")
        if kind in ("svc", "service"):
            return self.kubectl("get", "-n", namespace, "service", name, "-o", "jsonpath={.spec.clusterIP}").strip()
        if kind == "pod":
            return self.kubectl("get", "-n", namespace, "pod", name, "-o", "jsonpath={.status.podIP}").strip()
        if kind == "ip":
            return name
        raise ValueError(target)

    def connect(self, namespace: str, target: str, port: int) -> Forward:
        """Reach ``svc/NAME``, ``pod/NAME`` or ``ip/ADDRESS`` port ``port`` at the returned ``Forward.url``."""
        local = free_port()
        if self.netns:
            ip = self._target_ip(namespace, target)
            assert ip and ip != "None", f"{target} has no address"
            inner = f"{CLUSTER_SCRIPTS / 'netns-connect.sh'} {self.netns} {ip} {port}"  # socat splits EXEC at ':'
            args = ["socat", f"TCP-LISTEN:{local},bind=127.0.0.1,reuseaddr,fork", f"EXEC:{inner}"]
        else:
            args = [
                self.kubectl_bin,
                f"--kubeconfig={self.kubeconfig}",
                "port-forward",
                "-n",
                namespace,
                "--address=127.0.0.1",
                target,
                f"{local}:{port}",
            ]
        popen = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        forward = Forward(url=f"http://127.0.0.1:{local}", popen=popen)

        def listening() -> bool:
            if popen.poll() is not None:
                raise AssertionError(f"forwarder to {target}:{port} exited ({popen.returncode})")
            with contextlib.closing(socket.create_connection(("127.0.0.1", local), timeout=1)):
                return True

        try:
            wait_until(listening, timeout=20, what=f"a forwarder to {namespace}/{target}:{port}")
        except BaseException:
            forward.stop()
            raise
        return forward


# -------------------------------------------------------------------------------------------- backends
def provide_cluster(env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A generator: yields the cluster ``env`` (default ``os.environ``) selects, tears down what it started."""
    env = dict(os.environ if env is None else env)
    if env.get("SMG_E2E_KUBECONFIG"):
        yield from _existing(Path(env["SMG_E2E_KUBECONFIG"]), env)
    elif env.get("SMG_E2E_BACKEND", "") != "namespace" and shutil.which("kind"):
        yield from _kind(env)
    else:
        yield from _namespace(env)


def _kubectl_for(env: dict[str, str]) -> str:
    from support.kube import find_kubectl

    k = env.get("SMG_KUBECTL") or find_kubectl()
    if not k:
        raise Unavailable("no kubectl: run scripts/install-test-tools.sh")
    return k


def _existing(kubeconfig: Path, env: dict[str, str]) -> Iterator[Cluster]:
    if not kubeconfig.is_file():
        raise Unavailable(f"SMG_E2E_KUBECONFIG={kubeconfig} is not a file")
    yield Cluster(
        backend="kubeconfig",
        kubeconfig=kubeconfig,
        kubectl_bin=_kubectl_for(env),
        image=env.get("SMG_E2E_IMAGE", DEFAULT_IMAGE),
    )


def _kind(env: dict[str, str]) -> Iterator[Cluster]:
    for tool in ("docker", "kubectl"):
        if not shutil.which(tool):
            raise Unavailable(f"kind is on PATH but {tool} is not")
    name = env.get("SMG_E2E_KIND_CLUSTER", KIND_NAME)
    existed = name in _run(["kind", "get", "clusters"]).split()
    if not existed:
        _run(["kind", "create", "cluster", "--name", name, "--wait", "180s"], timeout=600)
    kubeconfig = Path(env.get("TMPDIR", "/tmp")) / f"smg-e2e-kind-{os.getpid()}.kubeconfig"
    kubeconfig.write_text(_run(["kind", "get", "kubeconfig", "--name", name]))

    def build(tag: str) -> int:
        _run(["docker", "build", "-t", tag, str(REPO)], timeout=1200)
        _run(["kind", "load", "docker-image", "--name", name, tag], timeout=600)
        return int(_run(["docker", "image", "inspect", tag, "--format", "{{.Size}}"]).strip())

    try:
        yield Cluster(
            backend="kind",
            kubeconfig=kubeconfig,
            kubectl_bin=shutil.which("kubectl") or "kubectl",
            image=env.get("SMG_E2E_IMAGE", DEFAULT_IMAGE),
            build_image=build,
        )
    finally:
        kubeconfig.unlink(missing_ok=True)
        if not existed and env.get("SMG_E2E_KEEP") != "1":
            _run(["kind", "delete", "cluster", "--name", name], timeout=300, check=False)


def namespace_unavailable() -> str | None:
    """Why the project's own cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the e2e cluster needs root (network and mount namespaces, dockerd, kubelet); set SMG_E2E_KUBECONFIG"
    for tool in ("ip", "nsenter", "unshare", "socat"):
        if not shutil.which(tool):
            return f"the e2e cluster needs {tool}: run scripts/install-e2e-tools.sh"
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network/mount namespaces here: {probe.stderr.strip()}"
    return None


def _session_lock(env: dict[str, str]) -> int:
    """An exclusive lock on the cluster's state folder for this whole session, waited for.

    There is one such cluster per machine (one namespace name, one state folder): a second test session would
    tear the first one's cluster down (up.sh starts with down.sh), so it waits until the first is done.
    """
    from support.kube import cache_dir

    state = Path(env.get("SMG_E2E_STATE") or cache_dir() / "e2e-cluster")
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / "session.lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + float(env.get("SMG_E2E_LOCK_WAIT", "900"))
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise AssertionError(f"another test session holds {state / 'session.lock'}") from None
            time.sleep(1)


def _namespace(env: dict[str, str]) -> Iterator[Cluster]:
    reason = namespace_unavailable()
    if reason:
        raise Unavailable(reason)
    lock = _session_lock(env)
    try:
        yield from _namespace_locked(env)
    finally:
        os.close(lock)  # releases the lock


def _namespace_locked(env: dict[str, str]) -> Iterator[Cluster]:
    up = subprocess.run(
        [str(CLUSTER_SCRIPTS / "up.sh")], capture_output=True, text=True, timeout=900, env={**os.environ, **env}
    )
    try:
        if up.returncode != 0:
            raise AssertionError(f"e2e/cluster/up.sh failed ({up.returncode}):\n{up.stderr[-6000:]}")
        kubeconfig = Path(up.stdout.strip().splitlines()[-1])
        settings = dict(
            line.split("=", 1) for line in (kubeconfig.parent / "cluster.env").read_text().splitlines() if "=" in line
        )

        def build(tag: str) -> int:
            out = _run([str(CLUSTER_SCRIPTS / "build-image.sh"), tag], timeout=1200)
            return int(out.strip().splitlines()[-1])

        yield Cluster(
            backend="namespace",
            kubeconfig=kubeconfig,
            kubectl_bin=settings["KUBECTL"],
            image=env.get("SMG_E2E_IMAGE", DEFAULT_IMAGE),
            netns=settings["NETNS"],
            holder_pid=int(settings["HOLDER_PID"]),
            build_image=build,
            figures={"up_log": up.stderr},
        )
    finally:
        down = subprocess.run([str(CLUSTER_SCRIPTS / "down.sh")], capture_output=True, text=True, timeout=300)
        if down.returncode != 0 or "netns=0 mounts=0" not in down.stdout:
            raise AssertionError(f"e2e/cluster/down.sh left something behind:\n{down.stdout}\n{down.stderr}")


def http_get(url: str, *, timeout: float = 10, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
