"""The repository speaks of the project only: no work-diary or tracker numbers, no documents it does not hold.

A comment that justifies a constant names the benchmark and the figure (docs/benchmarks.md has the command), not
when or under which ticket it was measured; history lives in git.  The patterns are assembled here so that this
file does not match itself.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

FORBIDDEN = "|".join(
    (
        "sess" + r"ions? [0-9]+",
        "iss" + r"ues? [0-9]+",
        r"(DESIGN|TESTING|STYLE)\.md",
        r"\bDES" + r"IGN [0-9]",
    )
)


def test_no_tracked_file_speaks_of_sessions_issues_or_outside_documents() -> None:
    done = subprocess.run(
        ["git", "grep", "-n", "-i", "-E", FORBIDDEN, "--", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: nothing found
    assert done.stdout == "", "\n" + done.stdout
