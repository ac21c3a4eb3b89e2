"""The trainer's benchmarks run, and the figures docs/trainer.md shows are those their results files hold."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "trainer.md").read_text()


def _table_after(heading: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after `heading`."""
    section = DOC[DOC.index(heading) :]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows, started = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif started:
            break
    assert lines, heading
    return rows[2:]


def test_the_equivalence_table_is_the_results_file() -> None:
    results = json.loads((REPO / "benchmarks/results/trainer_equivalence.json").read_text())
    rows = {row[0]: row for row in _table_after("### Equivalence")}
    assert rows.keys() == results["float64"].keys()
    for name, row in rows.items():
        f64, f32 = results["float64"][name], results["float32"][name]
        shown = [float(cell) for cell in (row[1], row[2], row[3], row[5], row[6], row[7])]
        wanted = [
            f64["max_abs_dlogit"], f64["max_abs_dgrad"], f64["max_abs_dweight"],
            f32["max_abs_dlogit"], f32["max_abs_dgrad"], f32["max_abs_dweight"],
        ]  # fmt: skip
        assert shown == pytest.approx(wanted, rel=0.06), name
        assert (row[4] == "yes") == (not f64["figures_differing"]), name


def test_the_sizing_table_is_what_the_script_computes(tmp_path: Path) -> None:
    out = tmp_path / "sizing.json"
    subprocess.run([sys.executable, "benchmarks/trainer_sizing.py", "--out", str(out)], cwd=REPO, check=True)
    assert json.loads(out.read_text()) == json.loads(
        (REPO / "benchmarks/results/trainer_sizing.json").read_text()
    )
    rows = _table_after("### Sizing for H200s")
    models = json.loads(out.read_text())["models"]
    for row in rows:
        name = re.sub(r" \(.*\)$", "", row[0])
        best = models[name]["by_gpus"][row[1]]["recommended"]
        assert row[2].startswith(f"TP{best['tensor']} EP{best['expert']} PP{best['pipeline']}"), row
        assert row[4].endswith(f"= {best['total_gb']:.0f}"), row


@pytest.mark.slow
def test_the_scale_benchmark_runs(tmp_path: Path) -> None:
    """`trainer_scale.py --quick` on two layouts (the whole sweep is the benchmark's job, not CI's)."""
    out = tmp_path / "scale.json"
    subprocess.run(
        [
            sys.executable,
            "benchmarks/trainer_scale.py",
            "--quick",
            "--layouts",
            "one rank,DP2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    report = json.loads(out.read_text())
    assert set(report["layouts"]) == {"one rank", "DP2"}
    for row in report["layouts"].values():
        assert row["tokens_per_second"] > 0 and row["weight_bytes"] > 0
    assert report["layouts"]["one rank"]["step_time_vs_one_rank"] == 1.0
