"""What every results file records of where it came from: the repository's commit.

Benchmarks run as scripts (`python benchmarks/NAME.py`), so this folder is on `sys.path` and they import
this module by its bare name."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The repository's HEAD, for the results file ("" outside a git checkout)."""
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"],  # noqa: S607 - git from PATH, as a developer runs it
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip()
