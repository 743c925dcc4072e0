"""Client load for the e2e tier, run as its own process (inside the cluster's network namespace when there is one).

``python load_client.py BASE_URL THREADS``: each thread sends completions with the official ``openai`` client,
no client retries (``max_retries=0``: a request the router or the network dropped counts as failed), until
SIGTERM; then one JSON line: ``{"sent": N, "failed": M, "errors": [...]}`` (the first errors, with causes).
Run in the namespace, its connections go to the Service's ClusterIP directly, as an in-cluster client's do.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import openai

PREFIX = "You are a careful assistant for the SMG end-to-end suite. " * 8


def main() -> None:
    base_url, threads = sys.argv[1], int(sys.argv[2])
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"sent": 0, "failed": 0}
    errors: list[str] = []
    answered = threading.Event()

    def run(index: int) -> None:
        with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
            n = 0
            while not stop.is_set():
                n += 1
                error = ""
                try:
                    reply = client.completions.create(
                        model="sim-model", prompt=f"{PREFIX} load {index}-{n}", max_tokens=2
                    )
                    if not reply.choices:
                        error = f"empty reply {reply}"
                except Exception as e:  # every failure is counted and reported
                    error = f"{time.monotonic():.1f} {type(e).__name__}: {e} ({e.__cause__!r})"
                if not error:
                    answered.set()
                with lock:
                    counts["sent"] += 1
                    if error:
                        counts["failed"] += 1
                        errors.append(error)

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    print("started" if answered.wait(30) else "no answer", flush=True)
    while not stop.is_set():
        stop.wait(0.2)
    for w in workers:
        w.join(timeout=60)
    print(json.dumps({**counts, "errors": errors[:10]}), flush=True)


if __name__ == "__main__":
    main()
