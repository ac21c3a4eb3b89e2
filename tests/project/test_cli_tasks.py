"""`legorl tasks ...` and `legorl sandbox trial`, run as a user runs them (the console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.sandbox.task import load_task_set

LEGORL = [sys.executable, "-m", "legorl.cli"]


def legorl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LEGORL, *args], capture_output=True, text=True, check=False, cwd=cwd)


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tasks")
    proc = legorl("tasks", "generate", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tasks," in proc.stdout
    return out / "tasks.jsonl"


def test_validate_reports_counts_and_errors(bundled: Path, tmp_path: Path) -> None:
    ok = legorl("tasks", "validate", str(bundled))
    assert ok.returncode == 0 and "tasks valid" in ok.stdout
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instance_id": "x", "base_commit": "nope"}\n')
    bad = legorl("tasks", "validate", str(broken))
    assert bad.returncode == 1
    assert "broken.jsonl:1 x: missing required field 'repo'" in bad.stderr or "base_commit" in bad.stderr


def test_import_swebench_from_parquet_names_images(bundled: Path, tmp_path: Path) -> None:
    """SWE-bench rows as a dataset exports them (Parquet, list fields as JSON text)."""
    rows = [json.loads(line) for line in bundled.read_text().splitlines()[:3]]
    swebench_rows = []
    for row in rows:
        swebench_rows.append(
            {
                "repo": row["repo"],
                "instance_id": row["instance_id"].replace("tiny-python__", "Tiny__"),
                "base_commit": row["base_commit"],
                "patch": row["patch"],
                "test_patch": row["test_patch"],
                "problem_statement": row["problem_statement"],
                "hints_text": "",
                "created_at": "2026-01-01T00:00:00Z",
                "version": "1.0",
                "FAIL_TO_PASS": json.dumps(row["FAIL_TO_PASS"]),
                "PASS_TO_PASS": json.dumps(row["PASS_TO_PASS"]),
                "environment_setup_commit": row["base_commit"],
            }
        )
    source = tmp_path / "swe.parquet"
    pq.write_table(pa.Table.from_pylist(swebench_rows), source)
    out = tmp_path / "tasks.jsonl"
    proc = legorl("tasks", "import-swebench", str(source), str(out))
    assert proc.returncode == 0, proc.stderr
    imported = load_task_set(out)
    first = imported.tasks[0]
    assert (
        first.image == f"swebench/sweb.eval.x86_64.{first.instance_id.lower().replace('__', '_1776_')}:latest"
    )
    assert first.fail_to_pass == tuple(rows[0]["FAIL_TO_PASS"])
    assert len(load_task_set(source)) == 3  # Parquet manifests load directly too


@pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs root and bubblewrap")
def test_sandbox_trial_runs_a_command_as_the_agent(bundled: Path, tmp_path: Path) -> None:
    task = json.loads(bundled.read_text().splitlines()[0])
    patch = task["patch"]
    fixed = legorl(
        "sandbox", "trial", "--root", str(tmp_path / "root"), "--tasks", str(bundled), "--task",
        task["instance_id"], "-o", "json", "--", "sh", "-c", f"git apply <<'EOF'\n{patch}EOF\n",
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    outcome = json.loads(fixed.stdout)
    assert (outcome["terminationReason"], outcome["reward"]) == ("completed", 1.0), outcome["error"]
    assert outcome["diff"].startswith("diff --git")
    idle = legorl("sandbox", "trial", "--root", str(tmp_path / "root"), "--tasks", str(bundled),
                  "--task", task["instance_id"], "--", "true")  # fmt: skip
    assert idle.returncode == 0 and "completed, reward 0.0" in idle.stdout
    missing = legorl("sandbox", "trial", "--tasks", str(bundled), "--task", "nope", "--", "true")
    assert missing.returncode == 2 and "no task 'nope'" in missing.stderr
