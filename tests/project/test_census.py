"""The string-keyed reads of another component's documents (scripts/census.py `cross_component_reads`) only go
down: at or below the ceiling in scripts/census-ceiling.json (issue 37)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cross_component_reads_stay_at_or_below_the_ceiling() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/census.py"), "--reads", "--repo", str(REPO)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts = json.loads(out)
    ceiling = json.loads((REPO / "scripts/census-ceiling.json").read_text())["cross_component_reads"]
    assert counts["total"] <= ceiling, (
        f"{counts['total']} string-keyed reads of another component's documents, more than the ceiling "
        f"{ceiling}: read them through their types in legorl.api ({counts})"
    )
    if counts["total"] < ceiling:
        print(
            f"fewer reads than the ceiling ({counts['total']} < {ceiling}): lower scripts/census-ceiling.json"
        )
