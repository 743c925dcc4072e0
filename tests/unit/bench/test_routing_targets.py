"""The routing benchmark's targets: ``smg:<policy>[+peers][~VARIANT][@REV]``, a variant adding its flags to every
replica and ``@REV`` running the router of a git revision, so that the arms of a comparison run side by side in one
run (same machine state, targets innermost)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "routing"))

from fleet import Launch, Target, parse_variants, resolve_commit, target_code  # noqa: E402


def test_a_variant_adds_its_flags_after_the_common_ones_and_names_the_target() -> None:
    variants = parse_variants(["nohold=--prefill-hold-seconds 0", 'quoted=--model-alias "a b"'])
    t = Target.parse("smg:cache_aware+peers~nohold", variants)
    assert (t.name, t.peers, t.flags) == ("smg:cache_aware+peers~nohold", True, ("--prefill-hold-seconds", "0"))
    argv = Launch(t, ["http://w:1"], 0.25, smg_args=["--cache-threshold", "0.5"]).argv(9000, peers=[9001])
    assert argv[-6:] == ["--peer", "http://127.0.0.1:9001", "--cache-threshold", "0.5", "--prefill-hold-seconds", "0"]
    assert Target.parse("rust:cache_aware~quoted", variants).flags == ("--model-alias", "a b")


def test_a_target_without_a_variant_keeps_its_name_and_flags() -> None:
    t = Target.parse("smg:round_robin")
    assert (t.name, t.peers, t.variant, t.flags) == ("smg:round_robin", False, "", ())


@pytest.mark.parametrize("peers", [False, True])
@pytest.mark.parametrize("variant", ["", "nohold"])
@pytest.mark.parametrize("rev", ["", "82e7b8e", "HEAD~1", "origin/main"])
def test_a_rev_comes_last_keeps_its_text_in_the_name_and_leaves_the_rest_as_without_it(
    peers: bool, variant: str, rev: str
) -> None:
    text = (
        "smg:cache_aware"
        + ("+peers" if peers else "")
        + (f"~{variant}" if variant else "")
        + (f"@{rev}" if rev else "")
    )
    t = Target.parse(text, parse_variants(["nohold=--prefill-hold-seconds 0"]))
    assert (t.kind, t.policy, t.peers, t.variant, t.rev) == ("smg", "cache_aware", peers, variant, rev)
    assert t.flags == (("--prefill-hold-seconds", "0") if variant else ())
    assert t.name == text


@pytest.mark.parametrize(
    "text",
    [
        "smg:cache_aware~missing",
        "rust:cache_aware+peers",
        "smg",
        "other:rr",
        "smg:cache_aware@",
        "rust:cache_aware@HEAD",
        "smg:@HEAD",
        "smg:cache_aware+peers~missing@HEAD",
        "smg:cache_aware+events+events",
        "smg:cache_aware+other",
    ],
)
def test_a_malformed_target_or_unknown_variant_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Target.parse(text, parse_variants(["known=--x 1"]))


def test_targets_at_two_commits_run_two_code_dirs_and_the_others_the_default(tmp_path: Path) -> None:
    head, parent = Target.parse("smg:cache_aware@HEAD"), Target.parse("smg:cache_aware+peers@HEAD~1")
    plain, rust = Target.parse("smg:round_robin"), Target.parse("rust:cache_aware")
    code = target_code([head, parent, plain, rust], None, tmp_path)
    assert set(code) == {head, parent, plain}  # a Rust target runs no smg-router
    assert code[head].commit == resolve_commit("HEAD") != code[parent].commit == resolve_commit("HEAD~1")
    assert code[head].pythonpath != code[parent].pythonpath
    for c in (code[head], code[parent]):
        assert c.pythonpath is not None and (c.pythonpath / "smg_router" / "__main__.py").is_file()
        listed = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", c.commit or "", "router/smg_router"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        extracted = sorted(str(p.relative_to(c.pythonpath.parent)) for p in c.pythonpath.rglob("*") if p.is_file())
        assert sorted(p for p in extracted if p.startswith("router/smg_router/")) == sorted(listed)
    assert (code[plain].commit, code[plain].pythonpath) == (None, None)  # the working tree
    assert target_code([plain], "HEAD~1", tmp_path)[plain] == code[parent]  # --router-commit, the same dir


def test_launch_puts_its_targets_code_first_on_pythonpath(tmp_path: Path) -> None:
    t = Target.parse("smg:cache_aware@HEAD")
    env = Launch(t, ["http://w:1"], 0.25, router_pythonpath=tmp_path).env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)


def test_an_events_target_reads_every_workers_events_with_the_sims_tokenizer() -> None:
    t = Target.parse("smg:cache_aware+peers+events@HEAD")
    assert (t.peers, t.events, t.rev, t.name) == (True, True, "HEAD", "smg:cache_aware+peers+events@HEAD")
    where = {"http://127.0.1.10:30000": ("tcp://127.0.1.10:4000", "tcp://127.0.1.10:4001")}
    argv = Launch(target=t, workers=list(where), time_scale=0.25, kv_events=where).argv(9000)
    assert argv[argv.index("--kv-events") + 1] == "http://127.0.1.10:30000=tcp://127.0.1.10:4000,tcp://127.0.1.10:4001"
    assert argv[argv.index("--tokenizer") + 1].endswith("smg_sim/tokenizer")
    plain = Launch(target=Target.parse("smg:cache_aware"), workers=list(where), time_scale=0.25, kv_events=where)
    assert "--kv-events" not in plain.argv(9000)
