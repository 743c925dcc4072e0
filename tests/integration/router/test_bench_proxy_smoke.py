"""The proxy benchmark's smoke run: ``bench/bench_proxy.py --quick`` (wrk, real smg-sim workers and routers on
loopback) completes every cell without a failed request and measures each router's CPU.  Asserts behaviour, not
speed: the figures themselves are in docs/benchmarks.md.  The Rust `smg` cells run where its binary is installed
(/tmp/smg-rust, docs/benchmarks.md), and so do vLLM's router's cells (/tmp/vllm-router); both are reported as skipped
elsewhere; ``wrk`` is installed by scripts/install-test-tools.sh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "bench_proxy.py"
RUST_BIN = "/tmp/smg-rust/bin/smg"
SMG_TARGETS = ["direct", "smg:round_robin", "smg:cache_aware"]
RUST_TARGETS = ["rust:round_robin", "rust:cache_aware"]
VLLM_BIN = "/tmp/vllm-router/bin/vllm-router"
VLLM_TARGETS = ["vllm:round_robin", "vllm:cache_aware"]


def run_bench(tmp_path: Path, *args: str, quick: bool = True) -> dict[str, Any]:
    assert shutil.which("wrk"), "wrk is missing: run scripts/install-test-tools.sh"
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *(["--quick"] if quick else []), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def refused(*args: str) -> subprocess.CompletedProcess[str]:
    """A quick run whose arguments stop it before anything starts."""
    return subprocess.run([sys.executable, str(BENCH), "--quick", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(180)
def test_quick_run_measures_every_cell_without_a_failed_request(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    rust, vllm = os.access(RUST_BIN, os.X_OK), os.access(VLLM_BIN, os.X_OK)
    expected = SMG_TARGETS + (RUST_TARGETS if rust else []) + (VLLM_TARGETS if vllm else [])
    assert result["skipped"] == ([] if rust else RUST_TARGETS) + ([] if vllm else VLLM_TARGETS)
    cells = {(c["target"], c["endpoint"], c["stream"], c["concurrency"]): c for c in result["cells"]}
    assert set(cells) == {(t, "chat", s, 8) for t in expected for s in (False, True)}
    for key, cell in cells.items():
        (run,) = cell["runs"]
        assert run["requests"] > 50, key
        assert run["errors"] == dict.fromkeys(("connect", "read", "write", "status", "timeout"), 0), key
        assert run["worker_cpu_us"] > 0, key
        if key[0] == "direct":
            assert run["cpu_us"] is None
        else:
            assert run["cpu_us"] > 0, key  # /proc accounting found the router's (and its children's) CPU
        assert cell["check"]["ok"], key
        if key[2]:
            assert cell["check"]["chunks"] == 4, key  # the "~4 chunks" streams of the benchmark


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("target", "flag"), [("rust:cache_aware", "--rust-bin"), ("vllm:cache_aware", "--vllm-bin")])
def test_a_missing_baseline_binary_skips_only_its_cells(tmp_path: Path, target: str, flag: str) -> None:
    missing = tmp_path / "no-such-router"
    result = run_bench(tmp_path, "--targets", f"smg:round_robin,{target}", flag, str(missing))
    assert result["skipped"] == [target]
    assert {c["target"] for c in result["cells"]} == {"smg:round_robin"}


@pytest.mark.timeout(90)
def test_vllm_router_serves_every_endpoint_bound_to_loopback(tmp_path: Path) -> None:
    """vLLM's router (where installed), through a wrapper that notes its arguments: /generate and chat, streamed and
    not, with no failed request; it listens, and serves its metrics on a port of its own, on 127.0.0.1 only."""
    if not os.access(VLLM_BIN, os.X_OK):
        pytest.skip(f"{VLLM_BIN} is not installed (docs/benchmarks.md)")
    noted = tmp_path / "noted"
    launcher = tmp_path / "vllm-router"
    launcher.write_text(f'#!/bin/sh\necho "$@" >> {noted}\nexec {VLLM_BIN} "$@"\n')
    launcher.chmod(0o755)
    quick = ["--reps", "1", "--duration", "1", "--warmup", "0", "--concurrency", "8"]  # --quick's, both endpoints
    args = ["--targets", "vllm:cache_aware", "--endpoints", "generate,chat", "--vllm-bin", str(launcher)]
    result = run_bench(tmp_path, *quick, *args, quick=False)
    cells = {(c["endpoint"], c["stream"]): c for c in result["cells"]}
    assert set(cells) == {(e, s) for e in ("generate", "chat") for s in (False, True)}
    for key, cell in cells.items():
        (run,) = cell["runs"]
        assert run["requests"] > 50 and sum(run["errors"].values()) == 0 and run["cpu_us"] > 0, key
        assert cell["check"]["ok"] and cell["check"].get("chunks", 4) == 4, key
    argv = noted.read_text().split()
    flag = {name: argv[argv.index(name) + 1] for name in ("--host", "--port", "--prometheus-host", "--prometheus-port")}
    assert flag["--host"] == flag["--prometheus-host"] == "127.0.0.1", argv
    assert flag["--port"] != flag["--prometheus-port"] != "29000", argv
    assert argv[argv.index("--policy") + 1] == "cache_aware", argv


@pytest.mark.timeout(90)
def test_a_target_with_a_peer_counts_both_routers_cpu(tmp_path: Path) -> None:
    """``smg:<policy>+peer``: a second router is the first's ``--peer``; the cell's CPU is both routers' (what a
    request costs a fleet of replicas that tell each other their routes)."""
    result = run_bench(tmp_path, "--targets", "smg:cache_aware,smg:cache_aware+peer", "--streams", "0")
    cells = {c["target"]: c for c in result["cells"]}
    assert set(cells) == {"smg:cache_aware", "smg:cache_aware+peer"}
    for cell in cells.values():
        (run,) = cell["runs"]
        assert run["requests"] > 50 and sum(run["errors"].values()) == 0 and run["cpu_us"] > 0


@pytest.mark.timeout(90)
def test_a_variant_target_runs_the_router_with_the_variants_flags(tmp_path: Path) -> None:
    """``smg:<policy>~NAME`` with ``--variant NAME=FLAGS``: the router gets those flags (a flag it does not know
    stops the run, naming it); a target naming no declared variant is refused before anything starts."""
    args = ["--targets", "smg:cache_aware~nocap", "--streams", "0", "--variant", "nocap=--tree-chars-per-token 0"]
    result = run_bench(tmp_path, *args)
    assert result["settings"]["variants"] == {"nocap": ["--tree-chars-per-token", "0"]}
    ((cell),) = result["cells"]
    assert cell["target"] == "smg:cache_aware~nocap" and sum(cell["runs"][0]["errors"].values()) == 0
    bad = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--targets", "smg:round_robin~bad", "--variant", "bad=--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--no-such-flag" in bad.stdout + bad.stderr
    undeclared = refused("--targets", "smg:round_robin~other")
    assert undeclared.returncode != 0 and "no --variant other=FLAGS" in undeclared.stderr


@pytest.mark.timeout(90)
def test_a_target_on_another_python_runs_the_router_on_it(tmp_path: Path) -> None:
    """``smg%PY:<policy>`` with ``--python PY=PATH``: the router runs on that interpreter (here a wrapper that notes
    its arguments, then runs this one); a target naming no declared Python is refused before anything starts."""
    noted = tmp_path / "noted"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {noted}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    result = run_bench(tmp_path, "--targets", "smg%alt:round_robin", "--streams", "0", "--python", f"alt={python}")
    assert result["settings"]["pythons"] == {"alt": str(python)}
    ((cell),) = result["cells"]
    (run,) = cell["runs"]
    assert cell["target"] == "smg%alt:round_robin" and sum(run["errors"].values()) == 0 and run["cpu_us"] > 0
    assert noted.read_text().startswith("-m smg_router --host 127.0.0.1"), noted.read_text()
    undeclared = refused("--targets", "smg%other:round_robin")
    assert undeclared.returncode != 0 and "no --python other=PATH" in undeclared.stderr
