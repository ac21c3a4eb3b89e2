"""benchmarks/learning.py end to end, short (CI's version of the learning protocol: one seed, two RL steps).

Everything is real: builtin://tiny-read generated, demonstrations recorded with mini-swe-agent's agent loop,
the warm start trained by megatron-core, `legorl run` (vLLM's CPU build, mini-swe-agent in local sandboxes,
GRPO, weight sync), the more-SFT baseline and its `legorl run` in Evaluate mode. The solve rates of so short
a run mean nothing; what is checked is the protocol: the splits are disjoint, the warm start and RL see no
validation or test task, the reported split is scored only for v0 and the final policy, and the results
file carries every field.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from legorl.api.store import RunStore
from legorl.sandbox import reading
from legorl.sandbox.task import load_task_set

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    work = tmp_path_factory.mktemp("learning")
    out = work / "learning.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--quick", "--work", str(work), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    log = (work / "learning.log").read_text() if (work / "learning.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-5000:]
    return work, json.loads(out.read_text())


def test_the_results_file_has_every_field(quick: tuple[Path, dict[str, Any]]) -> None:
    _, result = quick
    assert result["split_reported"] == "test"
    assert result["command"].startswith("python benchmarks/learning.py --quick")
    assert len(result["git_commit"]) >= 40
    assert result["settings"]["rl_steps"] == 2
    (seed,) = result["seeds"]
    for policy in ("v0", "final", "more_sft"):
        scored = seed[policy]
        assert scored["scored"] == 3, scored  # the quick run scores 3 test tasks once each
        assert 0 <= scored["solved"] <= 3
        low, high = scored["interval95"]
        assert 0 <= low <= high <= 1
        assert seed["behaviours"][policy]["trials"] == 3
        assert set(seed["behaviours"][policy]) >= {"read_tests_first", "wrote_a_fix", "right_found"}
    for gain in ("rl_gain", "more_sft_gain", "rl_vs_more_sft"):
        assert set(seed[gain]) == {"difference", "interval95"}
        assert set(result["pooled"][gain]) == {"difference", "interval95"}
    assert seed["rl_steps"] == 2
    assert set(seed["rewards_by_step"]) == {"1", "2"}
    assert "validation_copying" in seed["warm_start"]
    assert seed["seconds"]["total"] > 0
    assert set(result["pooled"]["target"]) >= {"gain_at_least_0.20", "intervals_apart", "seeds"}
    assert all(seed["checks"].values()), seed["checks"]


def test_the_splits_are_disjoint_and_only_train_and_test_tasks_reach_the_run(
    quick: tuple[Path, dict[str, Any]],
) -> None:
    work, _ = quick
    tasks = load_task_set(work / "seed-1" / "tasks.jsonl")
    splits = {t.instance_id: t.split for t in tasks}
    assert set(splits.values()) == {"train", "test"}  # no validation task in the reporting run
    assert sum(1 for s in splits.values() if s == "test") == 3
    store = RunStore(str(work / "seed-1" / "rl" / "run" / "store"))
    trained = {t.task_id for step in store.committed_steps() for t in store.read_batch(step).trials}
    assert trained and all(splits[t] == "train" for t in trained)


def test_the_warm_start_never_sees_a_validation_or_test_task(quick: tuple[Path, dict[str, Any]]) -> None:
    work, _ = quick
    demos = [json.loads(line) for line in (work / "demos-train.jsonl").read_text().splitlines()]
    by_id = reading.by_id()
    assert demos and all(by_id[d["task_id"]].split == "train" for d in demos)
    text = "\n".join(json.dumps(d) for d in demos)
    for task in reading.reading_tasks():
        if task.split != "train":
            assert task.instance_id not in text
            assert task.fix_command not in text
            assert task.diagnosis() not in text


def test_the_test_split_is_scored_only_for_v0_and_the_final_policy(
    quick: tuple[Path, dict[str, Any]],
) -> None:
    work, _ = quick
    store_dir = work / "seed-1" / "rl" / "run" / "store"
    scored = sorted(p.name for p in (store_dir / "trials" / "validation").iterdir())
    assert scored == ["step-000000", "step-000002"]
    evaluations = RunStore(str(store_dir)).eval_summaries()
    assert [e.step for e in evaluations] == [0, 2]
