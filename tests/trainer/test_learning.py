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
from tests.support.scripts import load_script

# benchmarks/learning.py --quick: a warm start and RL steps with the real engine and trainer.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


learning = load_script("learning", REPO / "benchmarks" / "learning.py")


def test_the_intervals_are_the_published_ones() -> None:
    # Newcombe (1998), Statistics in Medicine 17: 81/263 -> [0.2553, 0.3662] (Wilson, method 3) and
    # 56/70 - 48/80 -> [0.0524, 0.3339] (the hybrid score method, method 10).
    assert learning.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=5e-5)
    assert learning.newcombe(56, 70, 48, 80) == pytest.approx((0.0524, 0.3339), abs=5e-5)
    assert learning.wilson(0, 10)[0] == 0.0
    assert learning.wilson(10, 10)[1] == pytest.approx(1.0)
    pooled = learning.pooled(
        [
            {"v0": learning.rate(2, 40), "final": learning.rate(12, 40), "more_sft": learning.rate(4, 40)},
            {"v0": learning.rate(4, 40), "final": learning.rate(14, 40), "more_sft": learning.rate(4, 40)},
        ]
    )
    assert (pooled["v0"]["solved"], pooled["v0"]["scored"], pooled["final"]["solved"]) == (6, 80, 26)
    assert pooled["rl_gain"]["difference"] == pytest.approx(0.25)
    assert pooled["rl_gain"]["interval95"] == pytest.approx(learning.newcombe(26, 80, 6, 80))
    assert pooled["target"]["gain_at_least_0.20"] and pooled["target"]["intervals_apart"]


def test_what_a_trial_did_is_read_off_its_commands() -> None:
    diagnosis = "file=shopkit/cart.py line=13 found=bonus expected=weight"
    fix = f"sed -i '13s/bonus/weight/' shopkit/cart.py && {learning.SUBMIT}"
    right = learning.behaviour([reading.TEST_COMMAND, fix], diagnosis, reading.TEST_COMMAND)
    assert all(v for k, v in right.items() if k not in ("submitted_without_fix", "malformed_answer"))
    assert not right["submitted_without_fix"] and not right["malformed_answer"]
    wrong_line = learning.behaviour(
        [reading.TEST_COMMAND, fix.replace("13s", "12s"), None], diagnosis, reading.TEST_COMMAND
    )
    assert wrong_line["wrote_a_fix"] and not wrong_line["right_line"] and wrong_line["right_expected"]
    assert wrong_line["malformed_answer"]
    gave_up = learning.behaviour(["ls", learning.SUBMIT], diagnosis, reading.TEST_COMMAND)
    assert gave_up["submitted_without_fix"] and not gave_up["read_tests_first"] and not gave_up["wrote_a_fix"]


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
    assert len(demos) == 16  # --quick records the split's first 16 tasks (the full benchmark: all)
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
    # the baseline's Evaluate run scores the more-SFT model once, nothing else
    more = RunStore(str(work / "seed-1" / "more-sft-eval" / "run" / "store"))
    assert [e.step for e in more.eval_summaries()] == [0]
    assert more.committed_steps() == []


def test_no_held_out_text_reaches_an_rl_batch(quick: tuple[Path, dict[str, Any]]) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415 -- heavy

    work, _ = quick
    (warm,) = (work / "warm").iterdir()
    tokenizer = AutoTokenizer.from_pretrained(str(warm))
    store = RunStore(str(work / "seed-1" / "rl" / "run" / "store"))
    trials = [trial for step in store.committed_steps() for trial in store.read_batch(step).trials]
    text = "\n".join(str(tokenizer.decode(segment.token_ids)) for t in trials for segment in t.segments)
    # the decoded batches hold what the trials were given: each trained task's problem statement
    statements = {t.instance_id: t.problem_statement for t in load_task_set(work / "seed-1" / "tasks.jsonl")}
    assert trials and all(statements[t.task_id] in text for t in trials)
    for task in reading.reading_tasks():
        if task.split != "train":
            assert task.diagnosis() not in text, task.instance_id
            assert task.fix_command not in text, task.instance_id
