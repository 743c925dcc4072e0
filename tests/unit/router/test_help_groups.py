"""``smg-router --help``: every flag in one named section, the sections in order, and every tuning knob saying so
with the reason for its default."""

from __future__ import annotations

import argparse
import os
import re

import pytest
from smg_router.settings import DESIGN_NUMBERS, build_parser

SECTIONS = [
    "serving",
    "routing",
    "limits and timeouts",
    "prefill/decode disaggregation",
    "replicas",
    "endpoint picker",
    "admin API",
    "observability",
]
TUNING_HELP = re.compile(r"tuning: \S.*? \(default: (?P<default>[^;()]+); (?P<why>\S.*)\)")
"""``tuning: WHAT (default: VALUE; REASON)``, maybe followed by what the environment set."""


@pytest.fixture(autouse=True)
def no_smg_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line per help: the phrases below are not wrapped
    for var in [v for v in os.environ if v.startswith("SMG_")]:
        monkeypatch.delenv(var)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _tuning(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The tuning knobs, from the code: every numeric flag but the ones ``DESIGN_NUMBERS`` names."""
    return [a for a in _options(parser) if a.type in (int, float) and a.option_strings[0] not in DESIGN_NUMBERS]


def _shown(default: object) -> str:
    return f"{default:g}" if isinstance(default, float) else str(default)


def _problems(parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with the parser's sections and tuning helps; [] when nothing."""
    problems = []
    positional, generic, *named = parser._action_groups
    if [g.title for g in named] != SECTIONS:
        problems.append(f"sections {[g.title for g in named]}, expected {SECTIONS}")
    for group in (positional, generic):
        for action in group._group_actions:
            if not isinstance(action, argparse._HelpAction):
                name = action.option_strings[0] if action.option_strings else action.dest
                problems.append(f"{name} is in no named section ({group.title})")
    for action in _options(parser):
        holders = [g.title for g in named if action in g._group_actions]
        if len(holders) > 1:
            problems.append(f"{action.option_strings[0]} is in several sections: {holders}")
    tuning = _tuning(parser)
    for action in tuning:
        flag, text = action.option_strings[0], action.help or ""
        match = TUNING_HELP.match(text)
        if match is None:
            problems.append(f"{flag}: a tuning knob whose help is not 'tuning: ... (default: X; reason)': {text!r}")
        elif match["default"] != _shown(action.default):
            problems.append(f"{flag}: help says default {match['default']}, the flag's is {action.default!r}")
        elif len(match["why"].split()) < 2:
            problems.append(f"{flag}: no reason for the default: {match['why']!r}")
    for action in _options(parser):
        if action not in tuning and (action.help or "").startswith("tuning:"):
            problems.append(f"{action.option_strings[0]}: 'tuning:' on a flag that is no tuning knob")
    return problems


def test_every_flag_is_in_one_named_section_and_every_tuning_knob_gives_its_reason() -> None:
    assert _problems(build_parser()) == []


def test_the_sections_come_in_order_in_the_help_each_flag_under_its_own() -> None:
    text = build_parser().format_help()
    starts = [text.index(f"\n{title}:\n") for title in SECTIONS]
    assert starts == sorted(starts)
    options = text[text.index("\noptions:\n") : starts[0]]
    assert re.findall(r"^  (-\S+)", options, re.M) == ["-h,"]
    assert text.index("\n  --cache-threshold ") > starts[1]
    assert starts[3] < text.index("\n  --pd-mode ") < starts[4]
    assert text.index("\n  --health-failure-threshold ") > starts[6]


def test_the_tuning_knobs_are_the_numbers_people_tune() -> None:
    parser = build_parser()
    tuning = {a.option_strings[0] for a in _tuning(parser)}
    assert {"--cache-threshold", "--tree-memory-budget", "--request-timeout", "--peers-ready-grace"} <= tuning
    assert not tuning & {"--port", "--admin-port", "--policy", "--api-key", "--pd-mode", "--log-level"}
    text = parser.format_help()
    assert "tuning: minimum prefix match rate for a hit (default: 0.3; the SGLang router's default)" in text
    assert "(default: 30000)" in text  # a design choice shows its default, without "tuning:"


def test_a_flag_added_outside_the_sections_or_a_knob_without_its_reason_is_caught() -> None:
    parser = build_parser()
    parser.add_argument("--stray", help="no section")
    parser._action_groups[3].add_argument("--new-knob", type=float, default=1.0, help="tuning: seconds (default: 1)")
    problems = _problems(parser)
    assert any("--stray is in no named section" in p for p in problems)
    assert any(p.startswith("--new-knob: a tuning knob whose help") for p in problems)


def test_the_help_shows_a_value_from_the_environment_but_never_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMG_CACHE_THRESHOLD", "0.5")
    monkeypatch.setenv("SMG_API_KEY", "s3cret-data")
    monkeypatch.setenv("SMG_ADMIN_API_KEY", "s3cret-admin")
    parser = build_parser()
    text = parser.format_help()
    assert "(default: 0.3; the SGLang router's default) [now 0.5, from SMG_CACHE_THRESHOLD]" in text
    assert "s3cret" not in text
    assert parser.parse_args([]).cache_threshold == 0.5
    monkeypatch.delenv("SMG_CACHE_THRESHOLD")
    assert _problems(build_parser()) == []
