"""A real Kubernetes control plane on loopback for tests: etcd + kube-apiserver, no cluster.

It is envtest-style: no scheduler, no kubelet, no controllers.  Tests create Pod objects and play the
kubelet themselves (``make_ready_pod``, ``set_pod_ready``, ``mark_terminating``, ``release_pod``).
Everything listens on 127.0.0.1 only; pod IPs are loopback addresses (127.0.0.x) so anything that talks
to a "pod" stays on this machine.

Binaries (``scripts/install-test-tools.sh`` installs them all):

- ``etcd`` from Debian's etcd-server (or ``$SMG_ETCD``);
- ``kube-apiserver`` 1.20.2 built by ``scripts/build-kube-apiserver.sh`` into
  ``${XDG_CACHE_HOME:-~/.cache}/smg/kube-apiserver-1.20.2/`` (or ``$SMG_KUBE_APISERVER``);
- ``kubectl``: ``$SMG_KUBECTL``, else the one the install script linked at ``<cache>/smg/bin/kubectl``,
  else ``kubectl`` on PATH.

Facts of this API server (1.20) worth knowing in tests: status is only writable through the status
subresource (done here over REST, since kubectl 1.20 has no ``--subresource``); a pod without
``nodeName`` and without finalizers disappears at once on delete; CRD unknown fields are pruned by the
server, not rejected (only kubectl's client-side validation rejects them); Endpoints reject loopback IPs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

KUBE_VERSION = "1.20.2"
INSTALL_HINT = "run scripts/install-test-tools.sh (as root) to install etcd, kubectl and build kube-apiserver"
HOLD_FINALIZER = "smg.test/hold"
POD_IMAGE = "smg-sim:test"
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


# --------------------------------------------------------------------------------------------- tools
def cache_dir() -> Path:
    """Where the test tools are cached, outside git (``$SMG_CACHE_DIR`` or ``$XDG_CACHE_HOME/smg``)."""
    if os.environ.get("SMG_CACHE_DIR"):
        return Path(os.environ["SMG_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "smg"


def _executable(path: str | Path | None) -> str | None:
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return str(path)
    return None


def find_kube_apiserver() -> str | None:
    return (
        _executable(os.environ.get("SMG_KUBE_APISERVER"))
        or _executable(cache_dir() / f"kube-apiserver-{KUBE_VERSION}" / "kube-apiserver")
        or shutil.which("kube-apiserver")
    )


def find_etcd() -> str | None:
    return _executable(os.environ.get("SMG_ETCD")) or shutil.which("etcd")


def find_kubectl() -> str | None:
    return (
        _executable(os.environ.get("SMG_KUBECTL"))
        or _executable(cache_dir() / "bin" / "kubectl")
        or shutil.which("kubectl")
    )


class ToolsMissing(RuntimeError):
    """A binary the control plane needs is not installed."""


def require_tools() -> dict[str, str]:
    """Paths of etcd, kube-apiserver and kubectl, or ToolsMissing naming what is missing and how to fix it."""
    found = {"etcd": find_etcd(), "kube-apiserver": find_kube_apiserver(), "kubectl": find_kubectl()}
    missing = [name for name, path in found.items() if not path]
    if missing:
        raise ToolsMissing(f"missing {', '.join(missing)} for the real kube-apiserver tests: {INSTALL_HINT}")
    return {k: str(v) for k, v in found.items()}


# ------------------------------------------------------------------------------------------- helpers
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def wait_for(
    predicate: Callable[[], Any], *, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy; AssertionError with the last value on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except (OSError, ApiError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARS}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.0/8,localhost"
    env.update(extra or {})
    return env


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _write_rsa_key(path: Path) -> None:
    """A 2048-bit RSA private key (PEM) for signing service-account tokens."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
    except ImportError:
        openssl = shutil.which("openssl")
        if not openssl:
            raise ToolsMissing("neither the cryptography package nor the openssl CLI is available") from None
        subprocess.run([openssl, "genrsa", "-out", str(path), "2048"], check=True, capture_output=True)
    else:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        )
    path.chmod(0o600)


class ApiError(RuntimeError):
    """A non-2xx answer of the API server."""

    def __init__(self, method: str, path: str, status: int, body: Any):
        self.method, self.path, self.status, self.body = method, path, status, body
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path} -> {status}: {message}")


class KubectlError(subprocess.CalledProcessError):
    """CalledProcessError whose message includes kubectl's stderr (and stdout)."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr}\nstdout: {self.stdout}"


def write_kubeconfig(path: Path, server: str, token: str, *, user: str = "user", namespace: str = "default") -> Path:
    """A kubeconfig with one context: ``server`` (TLS not verified: its cert is self-signed) and a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "smg-test", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "smg-test", "context": {"cluster": "smg-test", "user": user, "namespace": namespace}}],
        "current-context": "smg-test",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    path.chmod(0o600)
    return path


# ------------------------------------------------------------------------------------- control plane
class ControlPlane:
    """etcd + kube-apiserver on free 127.0.0.1 ports, with an admin token (group system:masters) and RBAC.

    ``workdir`` holds etcd's data, the certificates, token file, service-account key and kubeconfigs; it is a
    fresh temp dir removed by ``stop()`` unless given.  ``log_dir`` gets ``etcd.log`` and ``kube-apiserver.log``
    (default ``workdir/logs``, so give one to keep the logs after ``stop()``; a failed start raises with their
    last lines either way).
    """

    ADMIN_USER = "smg-test-admin"
    ISSUER = "https://kubernetes.default.svc.cluster.local"

    def __init__(
        self,
        workdir: str | Path | None = None,
        log_dir: str | Path | None = None,
        *,
        start_timeout: float = 90.0,
        extra_apiserver_args: Iterable[str] = (),
        audit: bool = False,
    ):
        self._own_workdir = workdir is None
        self._workdir_arg = Path(workdir) if workdir else None
        self._log_dir_arg = Path(log_dir) if log_dir else None
        self.start_timeout = start_timeout
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.audit = audit
        """Opt-in: an audit log at level Metadata of every request (who did what, when); see ``audit_events``."""
        self.audit_log: Path | None = None
        self.workdir: Path | None = None
        self.log_dir: Path | None = None
        self.tools: dict[str, str] = {}
        self.server = ""
        self.token = ""
        self.kubeconfig: Path | None = None
        self.etcd_url = ""
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, Any] = {}
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self._ssl)
        )
        self._token_kubeconfigs = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        if self._procs:
            raise RuntimeError("control plane already started")
        self.tools = require_tools()
        if self._workdir_arg:
            self._workdir_arg.mkdir(parents=True, exist_ok=True)
            self.workdir = self._workdir_arg
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="smg-kube-"))
        self.log_dir = self._log_dir_arg or self.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_etcd()
            self._start_apiserver()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs[name] = log
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_clean_env(),
            cwd=self.workdir,
            start_new_session=True,
        )
        self._procs[name] = proc
        return proc

    def _fail(self, name: str, why: str) -> None:
        assert self.log_dir is not None
        log = self.log_dir / f"{name}.log"
        raise RuntimeError(f"{name} {why}; last lines of {log}:\n{_tail(log)}")

    def _wait(self, name: str, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            proc = self._procs[name]
            if proc.poll() is not None:
                self._fail(name, f"exited with code {proc.returncode} before {what}")
            with contextlib.suppress(OSError, ValueError, ssl.SSLError):
                if check():
                    return
            time.sleep(0.2)
        self._fail(name, f"did not become {what} within {self.start_timeout}s")

    def _start_etcd(self) -> None:
        assert self.workdir is not None
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        data = self.workdir / "etcd-data"
        data.mkdir(mode=0o700, exist_ok=True)
        self._spawn(
            "etcd",
            [
                self.tools["etcd"],
                "--name",
                "smg-test",
                "--data-dir",
                str(data),
                "--listen-client-urls",
                self.etcd_url,
                "--advertise-client-urls",
                self.etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"smg-test=http://127.0.0.1:{peer}",
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                f"smg-{secrets.token_hex(4)}",
                "--logger",
                "zap",
                "--log-level",
                "warn",
            ],
        )

        def healthy() -> bool:
            with self._opener.open(f"{self.etcd_url}/health", timeout=2) as resp:
                return json.loads(resp.read()).get("health") == "true"

        self._wait("etcd", healthy, "healthy")

    def _start_apiserver(self) -> None:
        assert self.workdir is not None
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        self.token = secrets.token_hex(24)
        certs = self.workdir / "certs"
        certs.mkdir(mode=0o700, exist_ok=True)
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(f'{self.token},{self.ADMIN_USER},{self.ADMIN_USER}-uid,"system:masters"\n')
        tokens.chmod(0o600)
        sa_key = self.workdir / "sa.key"
        _write_rsa_key(sa_key)
        self._spawn(
            "kube-apiserver",
            [
                self.tools["kube-apiserver"],
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--insecure-port=0",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
                f"--cert-dir={certs}",
                f"--etcd-servers={self.etcd_url}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                f"--service-account-issuer={self.ISSUER}",
                f"--api-audiences={self.ISSUER}",
                "--disable-admission-plugins=ServiceAccount",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--profiling=false",
                *self._audit_args(),
                *self.extra_apiserver_args,
            ],
        )

        def ready() -> bool:
            status, _ = self.request("GET", "/readyz", raw=True, timeout=3)
            return status == 200

        self._wait("kube-apiserver", ready, "ready (/readyz)")
        self.kubeconfig = write_kubeconfig(
            self.workdir / "admin.kubeconfig", self.server, self.token, user=self.ADMIN_USER
        )

    def _audit_args(self) -> list[str]:
        """--audit-policy-file (Metadata for every request, from ResponseComplete on) and --audit-log-path: one
        JSON event per line, written synchronously (the log backend's default blocking mode)."""
        if not self.audit:
            return []
        assert self.workdir is not None and self.log_dir is not None
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(
            json.dumps(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    "rules": [{"level": "Metadata"}],
                }
            )
        )
        self.audit_log = self.log_dir / "audit.log"
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-maxsize=0"]

    def audit_events(self) -> list[dict[str, Any]]:
        """Every audit event logged so far (``audit=True``): ``user.username``, ``verb``, ``objectRef``,
        ``requestReceivedTimestamp``, ``responseStatus.code``, ..."""
        if self.audit_log is None:
            raise RuntimeError("audit log not enabled: ControlPlane(audit=True)")
        if not self.audit_log.exists():
            return []
        events = []
        for line in self.audit_log.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written right now
                events.append(json.loads(line))
        return events

    def stop(self) -> None:
        for name in reversed(list(self._procs)):
            proc = self._procs.pop(name)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self._own_workdir and self.workdir is not None and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs.values())

    def log(self, name: str = "kube-apiserver", lines: int = 60) -> str:
        assert self.log_dir is not None
        return _tail(self.log_dir / f"{name}.log", lines)

    # -- REST --------------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        raw: bool = False,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        """One HTTPS request to the API server with the admin token (or ``token``): (status, parsed JSON body)."""
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {token or self.token}",
                "Content-Type": content_type,
                "Accept": "application/json",
            },
        )
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                status, payload = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        if raw:
            return status, payload.decode(errors="replace")
        try:
            return status, json.loads(payload) if payload else None
        except ValueError:
            return status, payload.decode(errors="replace")

    def api(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """Like ``request`` but raises ApiError on a non-2xx status and returns only the body."""
        status, payload = self.request(method, path, body, **kw)
        if not 200 <= status < 300:
            raise ApiError(method, path, status, payload)
        return payload

    # -- kubectl -----------------------------------------------------------------------------------
    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: str | Path | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this control plane (admin kubeconfig unless ``kubeconfig``); text output."""
        assert self.workdir is not None and self.kubeconfig is not None, "control plane not started"
        argv = [
            self.tools["kubectl"],
            f"--kubeconfig={kubeconfig or self.kubeconfig}",
            f"--cache-dir={self.workdir / 'kubectl-cache'}",
            *args,
        ]
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_clean_env({"KUBECONFIG": str(kubeconfig or self.kubeconfig)}),
        )
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def kubectl_json(self, *args: str, **kw: Any) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", **kw).stdout)

    def apply_yaml(
        self, text_or_path: str | Path, namespace: str | None = None, *extra: str
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl apply`` of a file (a Path, or a str naming an existing file) or of YAML text."""
        ns = ["-n", namespace] if namespace else []
        is_path = isinstance(text_or_path, Path) or ("\n" not in text_or_path and os.path.exists(text_or_path))
        if is_path:
            return self.kubectl("apply", *ns, "-f", str(text_or_path), *extra)
        return self.kubectl("apply", *ns, "-f", "-", *extra, input=str(text_or_path))

    def create_namespace(self, name: str) -> dict[str, Any]:
        return self.api(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        )

    def wait_crd_established(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"

        def established() -> dict[str, Any] | None:
            crd = self.api("GET", path)
            conds = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
            return crd if conds.get("Established") == "True" else None

        return wait_for(established, timeout=timeout, what=f"CRD {name} Established")

    # -- pods (the test plays the kubelet) ---------------------------------------------------------
    @staticmethod
    def _pod_path(namespace: str, name: str, sub: str = "") -> str:
        return f"/api/v1/namespaces/{namespace}/pods/{name}" + (f"/{sub}" if sub else "")

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        status, body = self.request("GET", self._pod_path(namespace, name))
        if status == 404:
            return None
        if status != 200:
            raise ApiError("GET", self._pod_path(namespace, name), status, body)
        return body

    def patch_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch ``status`` through the status subresource (what a kubelet does)."""
        return self.api(
            "PATCH",
            self._pod_path(namespace, name, "status"),
            {"status": status},
            content_type="application/merge-patch+json",
        )

    @staticmethod
    def _ready_status(ip: str, ready: bool, started: str) -> dict[str, Any]:
        now = now_rfc3339()
        flag = "True" if ready else "False"
        return {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": started,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": started},
                {"type": "Ready", "status": flag, "lastTransitionTime": now},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": started},
            ],
            "containerStatuses": [
                {
                    "name": "worker",
                    "image": POD_IMAGE,
                    "imageID": "",
                    "ready": ready,
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": started}},
                }
            ],
        }

    def make_ready_pod(
        self,
        namespace: str,
        name: str,
        labels: dict[str, str],
        ip: str,
        *,
        annotations: dict[str, str] | None = None,
        finalizers: list[str] | None = None,
        ready: bool = True,
        port: int | None = None,
    ) -> dict[str, Any]:
        """Create a Pod (one container, image smg-sim:test, never pulled: there is no kubelet) and set its status
        to Running with podIP ``ip`` and the Ready condition ``ready``.  Returns the pod after the status patch."""
        container: dict[str, Any] = {"name": "worker", "image": POD_IMAGE}
        if port:
            container["ports"] = [{"containerPort": port, "name": "http"}]
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
        if annotations:
            meta["annotations"] = dict(annotations)
        if finalizers:
            meta["finalizers"] = list(finalizers)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {
                "containers": [container],
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
            },
        }
        self.api("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
        return self.patch_pod_status(namespace, name, self._ready_status(ip, ready, now_rfc3339()))

    def set_pod_ready(self, namespace: str, name: str, ready: bool) -> dict[str, Any]:
        """Flip the pod's Ready/ContainersReady conditions (and its container's ready flag), keeping its IP."""
        pod = self.get_pod(namespace, name)
        if pod is None:
            raise ApiError("GET", self._pod_path(namespace, name), 404, "pod not found")
        status = pod.get("status", {})
        ip = status.get("podIP")
        if not ip:
            raise ValueError(f"pod {namespace}/{name} has no podIP: make it with make_ready_pod first")
        return self.patch_pod_status(
            namespace, name, self._ready_status(ip, ready, status.get("startTime") or now_rfc3339())
        )

    def _set_finalizers(self, namespace: str, name: str, finalizers: list[str], resource_version: str) -> None:
        self.api(
            "PATCH",
            self._pod_path(namespace, name),
            {"metadata": {"finalizers": finalizers, "resourceVersion": resource_version}},
            content_type="application/merge-patch+json",
        )

    def mark_terminating(self, namespace: str, name: str) -> dict[str, Any]:
        """Delete the pod while ``smg.test/hold`` (added if missing) keeps it: it stays, with deletionTimestamp
        set, as a kubelet would leave it during its grace period.  Returns the terminating pod."""
        for _ in range(5):
            pod = self.get_pod(namespace, name)
            if pod is None:
                raise ApiError("GET", self._pod_path(namespace, name), 404, "pod not found")
            finalizers = pod["metadata"].get("finalizers") or []
            if HOLD_FINALIZER in finalizers:
                break
            status, body = self.request(
                "PATCH",
                self._pod_path(namespace, name),
                {
                    "metadata": {
                        "finalizers": [*finalizers, HOLD_FINALIZER],
                        "resourceVersion": pod["metadata"]["resourceVersion"],
                    }
                },
                content_type="application/merge-patch+json",
            )
            if status == 200:
                break
            if status != 409:
                raise ApiError("PATCH", self._pod_path(namespace, name), status, body)
        self.api("DELETE", self._pod_path(namespace, name), {"kind": "DeleteOptions", "apiVersion": "v1"})
        pod = self.get_pod(namespace, name)
        if pod is None or not pod["metadata"].get("deletionTimestamp"):
            raise AssertionError(f"pod {namespace}/{name} is not terminating after delete: {pod!r}")
        return pod

    def release_pod(self, namespace: str, name: str, *, wait: bool = True, timeout: float = 30.0) -> None:
        """Remove ``smg.test/hold`` from the pod; a terminating pod then goes away (waited for if ``wait``)."""
        for _ in range(5):
            pod = self.get_pod(namespace, name)
            if pod is None:
                return
            finalizers = pod["metadata"].get("finalizers") or []
            if HOLD_FINALIZER not in finalizers:
                break
            status, body = self.request(
                "PATCH",
                self._pod_path(namespace, name),
                {
                    "metadata": {
                        "finalizers": [f for f in finalizers if f != HOLD_FINALIZER] or None,
                        "resourceVersion": pod["metadata"]["resourceVersion"],
                    }
                },
                content_type="application/merge-patch+json",
            )
            if status in (200, 404):
                break
            if status != 409:
                raise ApiError("PATCH", self._pod_path(namespace, name), status, body)
        if wait:
            pod = self.get_pod(namespace, name)
            if pod is not None and pod["metadata"].get("deletionTimestamp"):
                wait_for(
                    lambda: self.get_pod(namespace, name) is None, timeout=timeout, what=f"pod {namespace}/{name} gone"
                )

    # -- service accounts --------------------------------------------------------------------------
    def service_account_token(
        self, namespace: str, name: str, *, expiration_seconds: int = 3600, audiences: list[str] | None = None
    ) -> str:
        """A bound token for ServiceAccount ``namespace/name`` (created if absent) from the TokenRequest API.

        No controller-manager runs, so no token Secrets appear; TokenRequest signs a JWT with the apiserver's
        --service-account-signing-key-file for --service-account-issuer / --api-audiences."""
        sa_path = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        status, body = self.request(
            "POST", sa_path, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}
        )
        if status not in (201, 409):
            raise ApiError("POST", sa_path, status, body)
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if audiences:
            spec["audiences"] = audiences
        answer = self.api(
            "POST",
            f"{sa_path}/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return answer["status"]["token"]

    def kubeconfig_for_token(self, token: str, path: str | Path | None = None, *, namespace: str = "default") -> Path:
        """A kubeconfig for this API server that authenticates with ``token``."""
        assert self.workdir is not None, "control plane not started"
        if path is None:
            self._token_kubeconfigs += 1
            path = self.workdir / f"token-{self._token_kubeconfigs}.kubeconfig"
        return write_kubeconfig(Path(path), self.server, token, user="token-user", namespace=namespace)

    @staticmethod
    def token_claims(token: str) -> dict[str, Any]:
        """The (unverified) JWT payload of a service-account token, for assertions."""
        payload = token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))

    def whoami(self, token: str) -> dict[str, Any]:
        """Who the API server says ``token`` is (TokenReview by the admin): the ``status`` of the review."""
        review = self.api(
            "POST",
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}},
        )
        return review["status"]
