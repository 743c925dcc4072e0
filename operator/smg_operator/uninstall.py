"""``smg-operator-uninstall``: the chart's pre-delete hook.  Deletes the release's SMGWorkers and waits until
the running operator has deregistered them from every router replica and released its finalizer.

Without it ``helm uninstall`` deletes the operator's Deployment, its RBAC and the SMGWorkers at once: the
operator's deregistration still runs, but its status patch and finalizer update are refused (403), and the
SMGWorkers stay Terminating for ever.  A hook runs while everything of the release still exists.

Exit status: 0 when none is left; 1 when some remain at the deadline (the uninstall then fails and deletes
nothing: ``helm uninstall --no-hooks`` skips this wait, leaving such SMGWorkers Terminating).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from smg_operator import k8s

log = logging.getLogger("smg_operator.uninstall")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="smg-operator-uninstall",
        description="Delete the SMGWorkers a label selector picks and wait until the operator has released them.",
    )
    p.add_argument("--namespace", required=True)
    p.add_argument("--selector", required=True, help="label selector, e.g. app.kubernetes.io/instance=smg")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds to wait in all (default 240)")
    p.add_argument("--poll-interval", type=float, default=1.0)
    p.add_argument("--kube-request-timeout", type=float, default=10.0, help="seconds per API call (default 10)")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def sweep(s: k8s.SMGWorkerSweep, *, timeout: float, poll: float) -> list[str]:
    """Delete, then wait until none is left or ``timeout`` passes; returns what is left.  API errors are
    logged and tried again until the deadline (an API server restarting during an uninstall is no reason to
    fail it)."""
    deadline = time.monotonic() + timeout
    asked: list[str] | None = None
    left: list[str] = []
    while True:
        try:
            if asked is None:
                asked = s.delete()
                log.info(
                    "deleting %d SMGWorker(s) in %s (%s): %s",
                    len(asked),
                    s.namespace,
                    s.selector,
                    ", ".join(asked) or "none",
                )
            left = s.names()
            if not left:
                return []
        except Exception as e:  # the kubernetes client raises ApiException, urllib3 and socket errors
            log.warning("Kubernetes API call failed, trying again: %s: %s", type(e).__name__, e)
        if time.monotonic() >= deadline:
            return left if asked is not None else ["(could not list or delete any)"]
        time.sleep(poll)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    k8s.load_config()
    s = k8s.SMGWorkerSweep(namespace=args.namespace, selector=args.selector, timeout=args.kube_request_timeout)
    started = time.monotonic()
    left = sweep(s, timeout=args.timeout, poll=args.poll_interval)
    if left:
        log.error(
            "SMGWorker(s) still present after %.0f s: %s. Is smg-operator running and Ready? "
            "(`helm uninstall --no-hooks` skips this wait and leaves them Terminating)",
            args.timeout,
            ", ".join(left),
        )
        sys.exit(1)
    log.info("every SMGWorker deregistered and gone after %.1f s", time.monotonic() - started)


if __name__ == "__main__":
    main()
