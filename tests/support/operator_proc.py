"""``smg-operator`` as a real subprocess for tests, logged in through a kubeconfig (never in-cluster)."""

from __future__ import annotations

import sys
from pathlib import Path

from support.procs import Proc, free_port, http_json, wait_until


class OperatorProcess:
    def __init__(self, tmp: Path, kubeconfig: Path, *, admin_key: str, args: list[str] | None = None,
                 name: str = "smg-operator") -> None:
        self.metrics_port = free_port()
        env = {"KUBECONFIG": str(kubeconfig), "SMG_ADMIN_API_KEY": admin_key,
               # never in-cluster: a stray service host would send the operator somewhere off this machine
               "KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": ""}
        argv = [sys.executable, "-m", "smg_operator", "--metrics-host", "127.0.0.1",
                "--metrics-port", str(self.metrics_port), *(args or [])]
        self.proc = Proc(name=name, args=argv, log_path=tmp / f"{name}.log", env=env)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def start(self, timeout: float = 30.0) -> OperatorProcess:
        self.proc.start()
        try:
            wait_until(lambda: not self.proc.alive() or http_json("GET", self.metrics_url + "/healthz",
                                                                   timeout=1)[0] == 200,
                       timeout=timeout, what="smg-operator /healthz")
        except AssertionError:
            self.proc.stop()
            raise
        assert self.proc.alive(), self.proc.log()
        return self

    def metrics(self) -> str:
        status, body = http_json("GET", self.metrics_url + "/metrics", timeout=5)
        assert status == 200, body
        return str(body)

    def stop(self) -> None:
        self.proc.stop()
