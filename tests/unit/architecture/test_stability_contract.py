"""The lists docs/stability.md calls contracts equal the code: every flag (docs/flags.md), every metric
(docs/metrics.md), every ``x-smg-`` header (docs/stability.md), and nothing else."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase
from smg_operator.metrics import OperatorMetrics
from smg_operator.settings import build_parser as operator_parser
from smg_router.core import RouterCore
from smg_router.settings import build_parser as router_parser
from smg_router.settings import parse_settings

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"


def _sections(path: Path) -> dict[str, list[list[str]]]:
    """The rows of each table of a markdown file, by the ``## `` heading above it (``""`` before any)."""
    sections: dict[str, list[list[str]]] = {}
    heading = ""
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        elif line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip()[1:-1].split("|")]  # a cell holds no unescaped pipe
            sections.setdefault(heading, []).append(cells)
    return {h: rows[1:] for h, rows in sections.items()}  # each table's first row is its header


def _code(cell: str) -> str:
    m = re.fullmatch(r"`([^`]*)`", cell)
    assert m, f"expected one `name` in the cell {cell!r}"
    return m.group(1)


def _flags(parser: argparse.ArgumentParser, prefix: str) -> dict[str, tuple[str, str]]:
    """Flag -> (its environment variable, its kind) for every flag a user may set."""
    flags: dict[str, tuple[str, str]] = {}
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        flag = max(action.option_strings, key=len)
        kind = "tuning" if (action.help or "").startswith("tuning:") else "setting"
        flags[flag] = (prefix + flag.lstrip("-").upper().replace("-", "_"), kind)
    return flags


@pytest.mark.parametrize(
    ("program", "parser", "prefix"),
    [("smg-router", router_parser, "SMG_"), ("smg-operator", operator_parser, "SMG_OPERATOR_")],
)
def test_every_flag_is_listed_with_its_variable_and_kind_and_nothing_else(
    program: str, parser: Callable[[], argparse.ArgumentParser], prefix: str
) -> None:
    rows = _sections(DOCS / "flags.md")[f"`{program}`"]
    documented = {_code(r[0]): (_code(r[1]), r[4]) for r in rows}
    assert len(documented) == len(rows), "a flag is listed twice"
    code = _flags(parser(), prefix)
    assert sorted(set(code) - set(documented)) == [], "flags missing from docs/flags.md"
    assert sorted(set(documented) - set(code)) == [], "docs/flags.md lists flags the parser does not have"
    assert documented == code


def _families(collected: object) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposed name -> (type, label names) of every family a registry yields."""
    families = {}
    for metric in collected:  # type: ignore[attr-defined]
        name = metric.name + ("_total" if metric.type == "counter" else "")
        families[name] = (metric.type, tuple(metric._labelnames))
    return families


def _documented(rows: list[list[str]]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Name -> (type, label names) from a metrics table: the labels cell names each label, maybe with its values in
    parentheses (``reason (`a`, `b`)``)."""
    documented = {}
    for name, kind, labels, *_ in rows:
        bare = re.sub(r"\([^)]*\)", "", labels)
        documented[_code(name)] = (kind, tuple(word.strip() for word in bare.split(",") if word.strip()))
    return documented


def test_every_router_metric_is_listed_with_its_type_and_labels_and_nothing_else() -> None:
    # Peers on, so that the scrape-time families of every part are registered; nothing is started.
    core = RouterCore(parse_settings(["--peer", "http://127.0.0.1:9", "--peer-secret", "s" * 32]))
    code = _families(core.metrics.registry.collect())
    documented = _documented(_sections(DOCS / "metrics.md")[""])
    assert sorted(set(code) - set(documented)) == [], "metrics missing from docs/metrics.md"
    assert sorted(set(documented) - set(code)) == [], "docs/metrics.md lists metrics the router does not export"
    assert documented == code


def test_every_operator_metric_is_listed_with_its_type_and_labels_and_nothing_else() -> None:
    metrics = [m for m in vars(OperatorMetrics()).values() if isinstance(m, MetricWrapperBase)]
    code = {m._name + ("_total" if m._type == "counter" else ""): (m._type, tuple(m._labelnames)) for m in metrics}
    assert code, "the operator defines no metric: the scan is broken"
    assert _documented(_sections(DOCS / "metrics.md")["The operator's"]) == code


def test_every_smg_header_the_router_names_is_in_the_stability_table() -> None:
    named = set()
    for path in (ROOT / "router" / "smg_router").rglob("*.py"):
        named |= set(re.findall(r"\bx-smg-[a-z0-9-]*[a-z0-9]", path.read_text()))
    rows = _sections(DOCS / "stability.md")["What is a contract"]
    listed = {_code(r[0].split(" (")[0]) for r in rows if r[0].startswith("`x-smg-")}
    assert named, "the router names no x-smg- header: the scan is broken"
    assert sorted(named - listed) == []
    assert sorted(listed - named) == []
