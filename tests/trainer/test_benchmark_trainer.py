"""The trainer's benchmarks run, and the figures docs/trainer.md shows are those their results files hold."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


def test_the_hybrid_family_tables_are_the_results_file() -> None:
    results = json.loads((REPO / "benchmarks/results/hybrid_equivalence.json").read_text())
    heading = "### Equivalence (`benchmarks/hybrid_equivalence.py`)"
    families = {"Qwen3-Next": "qwen3_next", "Qwen3.5-MoE (text)": "qwen3_5_moe"}
    rows = {row[0]: row for row in _table_after(heading)}
    assert rows.keys() == families.keys()
    for label, family in families.items():
        got, row = results["transformers"][family], rows[label]
        shown = [float(row[1]), float(row[2]), float(row[4]), float(row[5].split()[0])]
        wanted = [
            got["logits"]["median_abs_dlogit_per_sequence"],
            got["logits"]["max_abs_dlogit"],
            max(got["gated_delta_net_layer_rel_delta"].values()),
            got["gradients"]["worst_rel_delta"],
        ]
        assert shown == pytest.approx(wanted, rel=0.06), label
        assert (row[6] == "yes") == got["export_bit_exact"] is True, label
    section = DOC[DOC.index(heading) :]
    controls = {row[0]: row for row in _rows_of_table(section, "| control |")}
    assert controls.keys() == results["transformers"]["qwen3_next"]["controls_max_abs_dlogit"].keys()
    for name, row in controls.items():
        for cell, family in ((row[1], "qwen3_next"), (row[2], "qwen3_5_moe")):
            assert float(cell) == pytest.approx(
                results["transformers"][family]["controls_max_abs_dlogit"][name], abs=0.01
            )
    layouts = {row[0]: row for row in _rows_of_table(section, "| layout |")}
    assert layouts.keys() == results["layouts_float64"].keys()
    for name, row in layouts.items():
        got = results["layouts_float64"][name]
        shown = [float(cell) for cell in row[1:4]]
        wanted = [got["max_abs_dlogit"], got["max_abs_dgrad"], got["max_abs_dweight"]]
        assert shown == pytest.approx(wanted, rel=0.06, abs=1e-300), name
        assert (row[4] == "yes") == (not got["figures_differing"]), name


def _rows_of_table(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with `header`."""
    lines = text[text.index(header) :].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


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
