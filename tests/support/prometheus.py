"""A real Prometheus (Debian's ``prometheus`` package) on loopback for the observability tests, plus PromQL helpers.

``start_prometheus`` writes a config, runs ``/usr/bin/prometheus`` with its own TSDB under the test's tmp
dir and a loopback ``--web.listen-address``, and waits until it is ready.  The helpers evaluate queries
through ``/api/v1/query``, extract the metric names an expression refers to (Prometheus answers an unknown
metric with an empty result, not an error, so names are checked separately), and list the metric
families of a ``/metrics`` exposition.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from support.procs import Proc, free_port, wait_until

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
MISSING = "Debian's prometheus package is not installed (apt-get install prometheus; scripts/install-test-tools.sh)"


@dataclass
class Prometheus:
    proc: Proc
    url: str

    def get(self, path: str, **params: str) -> dict[str, Any]:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:  # 400/422 carry the error as JSON
            return json.loads(e.read())

    def query(self, expr: str) -> dict[str, Any]:
        """The whole ``/api/v1/query`` answer: ``status`` is "success" or "error" (with ``error``)."""
        return self.get("/api/v1/query", query=expr)

    def query_range(self, expr: str, seconds: float = 120, step: str = "1s") -> dict[str, Any]:
        end = time.time()
        return self.get("/api/v1/query_range", query=expr, start=f"{end - seconds:.3f}", end=f"{end:.3f}", step=step)

    def vector(self, expr: str) -> list[dict[str, Any]]:
        answer = self.query(expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def targets_up(self) -> int:
        data = self.get("/api/v1/targets")["data"]["activeTargets"]
        return sum(t["health"] == "up" for t in data)

    def stop(self) -> None:
        self.proc.stop()


def start_prometheus(
    tmp: Path,
    scrape_configs: list[dict[str, Any]],
    *,
    scrape_interval: str = "1s",
    rule_files: list[Path] | None = None,
) -> Prometheus:
    assert Path(PROMETHEUS).exists(), MISSING
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "evaluation_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
        },
        "scrape_configs": scrape_configs,
    }
    if rule_files:
        config["rule_files"] = [str(p) for p in rule_files]
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    storage = tmp / "prometheus-data"
    args = [
        PROMETHEUS,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={storage}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        "--storage.tsdb.retention.time=1h",
    ]
    proc = Proc(name=f"prometheus-{port}", args=args, log_path=tmp / "prometheus.log").start()
    prom = Prometheus(proc=proc, url=f"http://127.0.0.1:{port}")

    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"prometheus exited:\n{proc.log()}")
        with urllib.request.urlopen(prom.url + "/-/ready", timeout=1) as resp:
            return resp.status == 200

    try:
        wait_until(ready, timeout=30, what="prometheus /-/ready")
    except BaseException:
        proc.stop()
        raise
    return prom


def promtool_check_rules(path: Path) -> subprocess.CompletedProcess[str]:
    assert Path(PROMTOOL).exists(), MISSING
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


# -- PromQL and exposition helpers ---------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORD = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
    "start",
    "end",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, labels, durations or numbers)."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors and subqueries
    s = _GROUPING.sub(" ", s)  # label lists of by/without/on/ignoring/group_*
    names = set()
    for m in _WORD.finditer(s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def exported_names(exposition: str) -> set[str]:
    """Every series name a ``/metrics`` page can produce: declared families (histograms with _bucket/_sum/_count,
    labelled metrics that have no sample yet included) and the samples present."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            if kind.strip() == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind.strip() == "summary":
                names |= {name, f"{name}_sum", f"{name}_count"}
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names
