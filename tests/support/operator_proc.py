"""``smg-operator`` as a real subprocess for tests, logged in through a kubeconfig (never in-cluster)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from support.procs import Proc, free_port, http_json, metric_value, wait_until

NO_PASSWD_ENTRY = """
import pwd, runpy
def getpwuid(uid):
    raise KeyError(f"getpwuid(): uid not found: {uid}")
pwd.getpwuid = getpwuid
runpy.run_module("smg_operator", run_name="__main__", alter_sys=True)
"""
"""``python -c`` code that runs smg-operator as in a container whose uid has no passwd entry (an arbitrary
``runAsUser``): ``pwd.getpwuid`` raises as it does there.  The real thing (another uid) cannot run this venv:
its interpreter lives under root's home."""

SETTLE = 30.0
"""How long a wait on the operator may take before it is a failure, in either operator tier.  Generous on
purpose: the machine is shared and at times slow, and no test measures the operator's speed in seconds.
Where "how soon" matters, a test counts the operator's own reconcile passes (``passes_until``) instead."""


class OperatorProcess:
    def __init__(
        self,
        tmp: Path,
        kubeconfig: Path,
        *,
        admin_key: str,
        args: list[str] | None = None,
        name: str = "smg-operator",
        no_passwd_entry: bool = False,
    ) -> None:
        self.metrics_port = free_port()
        env = {
            "KUBECONFIG": str(kubeconfig),
            "SMG_ADMIN_API_KEY": admin_key,
            # never in-cluster: a stray service host would send the operator somewhere off this machine
            "KUBERNETES_SERVICE_HOST": "",
            "KUBERNETES_SERVICE_PORT": "",
        }
        if no_passwd_entry:  # getpass.getuser() reads these before it asks pwd; a container sets none of them
            env.update(dict.fromkeys(("LOGNAME", "USER", "LNAME", "USERNAME"), ""))
        argv = [
            sys.executable,
            *(["-c", NO_PASSWD_ENTRY] if no_passwd_entry else ["-m", "smg_operator"]),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics_port),
            *(args or []),
        ]
        self.proc = Proc(name=name, args=argv, log_path=tmp / f"{name}.log", env=env)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def start(self, timeout: float = 30.0) -> OperatorProcess:
        """Start it and wait until it is ready (``/readyz`` 200: kopf runs, and it leads if elections are on)."""
        self.proc.start()
        try:
            wait_until(
                lambda: not self.proc.alive() or self.probe("/readyz") == 200,
                timeout=timeout,
                what="smg-operator /readyz",
            )
        except AssertionError:
            self.proc.stop()
            raise
        assert self.proc.alive(), self.proc.log()
        return self

    def probe(self, path: str) -> int:
        """The status of ``/healthz`` or ``/readyz`` (an OSError when nothing answers)."""
        return http_json("GET", self.metrics_url + path, timeout=2)[0]

    def metrics(self) -> str:
        status, body = http_json("GET", self.metrics_url + "/metrics", timeout=5)
        assert status == 200, body
        return str(body)

    def reconcile_passes(self) -> int:
        """``smg_operator_reconcile_total`` over every result: the operator's own clock, in reconcile passes."""
        return int(metric_value(self.metrics(), "smg_operator_reconcile_total"))

    def passes_until(
        self, predicate: Callable[[], bool], *, what: str, timeout: float = SETTLE, start: int | None = None
    ) -> int:
        """Wait for ``predicate``; the ordinal, counted from this call (or from ``start``, an earlier reading of
        ``reconcile_passes()``), of the reconcile pass that made it true (1: the pass in flight then, or the next).

        That is one more than the passes finished at the last check where it did not hold yet (the count is read
        before each check).  Exact while passes are further apart than the 50 ms between checks, as the timer's
        are (``--reconcile-interval``); passes poked in a quick burst could make it count too few."""
        start = last_failed = self.reconcile_passes() if start is None else start

        def check() -> bool:
            nonlocal last_failed
            finished = self.reconcile_passes()
            held = False
            try:
                held = bool(predicate())
            finally:
                if not held:  # also when the predicate raised: wait_until retries an OSError
                    last_failed = finished
            return held

        wait_until(check, timeout=timeout, what=what)
        return last_failed - start + 1

    def stop(self) -> None:
        self.proc.stop()
