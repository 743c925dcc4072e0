"""The Endpoint Picker benchmark's smoke run: ``bench/bench_epp.py --quick`` (wrk, real smg-sim workers, SMG as the
proxy and as the picker behind a real Envoy, Envoy alone) completes every cell without a failed request and measures
each part's CPU.  Asserts behaviour, not speed: the figures are in docs/benchmarks.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "bench_epp.py"


@pytest.mark.timeout(180)
def test_quick_run_measures_every_cell_of_every_way_to_the_workers(tmp_path: Path) -> None:
    assert shutil.which("wrk"), "wrk is missing: run scripts/install-test-tools.sh"
    out = tmp_path / "epp.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    cells = {(c["target"], c["stream"]): c for c in result["cells"]}
    assert set(cells) == {(t, s) for t in ("direct", "envoy", "smg", "epp") for s in (False, True)}
    for (target, stream), cell in cells.items():
        (run,) = cell["runs"]
        assert run["requests"] > 20, (target, stream)
        assert sum(run["errors"].values()) == 0, (target, stream)
        assert cell["check"]["ok"], (target, stream)
        assert (run["cpu_us"] is not None and run["cpu_us"] > 0) == (target in ("smg", "epp")), (target, run)
        assert (run["worker_cpu_us"] > 0) == (target in ("envoy", "epp")), (target, run)  # Envoy's CPU here
        if stream:
            assert cell["check"]["chunks"] == 4, (target, cell["check"])  # the stream arrived whole
    assert "| epp |" in proc.stdout and "Envoy CPU" in proc.stdout
