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


def test_the_unclustered_interval_is_the_published_one() -> None:
    # Newcombe (1998), Statistics in Medicine 17: 81/263 -> [0.2553, 0.3662] (Wilson, method 3).
    assert learning.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=5e-5)
    assert learning.wilson(0, 10)[0] == 0.0
    assert learning.wilson(10, 10)[1] == pytest.approx(1.0)


Outcomes = dict[str, list[int]]


def _policies(v0: Outcomes, final: Outcomes, more: Outcomes | None = None) -> dict[str, Outcomes]:
    return {"v0": v0, "final": final, "more_sft": more if more is not None else v0}


def test_the_clustered_bootstrap_resamples_tasks_and_pairs_the_policies() -> None:
    tasks = [f"t{i:03d}" for i in range(200)]
    # one sample per task, 60 of 200 solved: with independent samples the bootstrap is Wilson's interval
    once = {t: [int(i < 60)] for i, t in enumerate(tasks)}
    result = learning.clustered([_policies(once, once)])
    assert result["v0"]["rate"] == pytest.approx(0.3)
    assert result["v0"]["interval95"] == pytest.approx(learning.wilson(60, 200), abs=0.015)
    # the same outcomes for both policies: a paired difference of exactly 0, whatever the draw
    assert result["rl_gain"]["difference"] == 0.0
    assert result["rl_gain"]["interval95"] == (0.0, 0.0)
    # four samples a task that always agree are worth one sample a task, not four: the clustered interval
    # is as wide as the one-sample one, where counting 800 independent samples would halve it
    agreeing = {t: [int(i < 60)] * 4 for i, t in enumerate(tasks)}
    wide = learning.clustered([_policies(agreeing, agreeing)])["v0"]
    assert wide["scored"] == 800 and wide["tasks"] == 200
    width = wide["interval95"][1] - wide["interval95"][0]
    unclustered = wide["wilson95_unclustered"][1] - wide["wilson95_unclustered"][0]
    assert width == pytest.approx(result["v0"]["interval95"][1] - result["v0"]["interval95"][0], rel=0.15)
    assert width > 1.7 * unclustered
    # two seeds on the same tasks: one draw of tasks for both seeds, rates over all their samples
    better = {t: [1] for t in tasks[:120]} | {t: [0] for t in tasks[120:]}
    two = learning.clustered([_policies(once, better), _policies(once, better)])
    assert (two["v0"]["scored"], two["final"]["solved"]) == (400, 240)
    assert two["rl_gain"]["difference"] == pytest.approx(0.3)
    low, high = two["rl_gain"]["interval95"]
    assert 0.2 < low < 0.3 < high < 0.4
    # seeded: a rerun reports the same figures
    assert learning.clustered([_policies(once, better)]) == learning.clustered([_policies(once, better)])


def test_the_target_is_read_off_the_pooled_intervals() -> None:
    tasks = [f"t{i:02d}" for i in range(40)]
    v0 = {t: [int(i < 8)] * 4 for i, t in enumerate(tasks)}
    final = {t: [int(i < 24)] * 4 for i, t in enumerate(tasks)}
    more = {t: [int(i < 12)] * 4 for i, t in enumerate(tasks)}
    seeds = [{"per_task": _policies(v0, final, more)} for _ in range(3)]
    pooled = learning.pooled(seeds)
    assert pooled["rl_gain"]["difference"] == pytest.approx(0.4)
    assert pooled["target"] == {
        "wanted": pooled["target"]["wanted"],
        "gain_at_least_0.20": True,
        "intervals_apart": True,
        "rl_ahead_of_more_sft": True,
        "seeds": 3,
    }
    level = learning.pooled([{"per_task": _policies(v0, v0, v0)}])
    assert not any(
        level["target"][k] for k in ("gain_at_least_0.20", "intervals_apart", "rl_ahead_of_more_sft")
    )


def test_a_finished_phase_is_not_run_again(tmp_path: Path) -> None:
    calls: list[int] = []

    def work() -> dict[str, int]:
        calls.append(1)
        return {"answer": 42}

    assert learning._phase(tmp_path, "rl", work)[0] == {"answer": 42}
    result, seconds = learning._phase(tmp_path, "rl", work)
    assert (result, len(calls)) == ({"answer": 42}, 1) and seconds >= 0

    def crash() -> None:
        raise RuntimeError("cut off")

    with pytest.raises(RuntimeError):
        learning._phase(tmp_path, "more-sft", crash)
    assert not (tmp_path / "phase-more-sft.json").exists()  # a phase cut off midway runs again


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


def _run_quick(work: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """`benchmarks/learning.py --quick` in `work`, its results to `out`."""
    return subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--quick", "--work", str(work), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    work = tmp_path_factory.mktemp("learning")
    out = work / "learning.json"
    proc = _run_quick(work, out)
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
        # the quick run scores 3 test tasks twice each (an infrastructure failure would be counted)
        assert (scored["scored"], scored["tasks"]) == (6, 3), scored
        assert seed["tasks_scored_fewer_times"][policy] == 0
        assert 0 <= scored["solved"] <= 6
        assert sum(map(sum, seed["per_task"][policy].values())) == scored["solved"]
        low, high = scored["interval95"]
        assert 0 <= low <= scored["rate"] <= high <= 1
        assert seed["behaviours"][policy]["trials"] == 6
        assert set(seed["behaviours"][policy]) >= {"read_tests_first", "wrote_a_fix", "right_found"}
    # every RL step's figures: the trainer's, the batch's groups, the malformed answers
    assert [f["step"] for f in seed["steps"]] == [1, 2]
    for figures in seed["steps"]:
        assert figures["trainer"]["step"] == figures["step"]
        assert figures["trainer"].get("skipped") or figures["trainer"]["entropy"] is not None
        assert figures["batch"]["trials"] == 4  # 2 tasks x 2 trials
        groups = figures["groups_all_solved"] + figures["groups_none_solved"] + figures["groups_mixed"]
        assert groups == 2
        assert figures["answers"] >= 4 and 0 <= figures["malformed_answer_rate"] <= 1
    for gain in ("rl_gain", "more_sft_gain", "rl_vs_more_sft"):
        assert set(seed[gain]) == {"difference", "interval95"}
        assert set(result["pooled"][gain]) == {"difference", "interval95"}
    assert seed["rl_steps"] == 2
    assert set(seed["rewards_by_step"]) == {"1", "2"}
    assert "validation_copying" in seed["warm_start"]
    assert seed["seconds"]["total"] > 0
    assert set(result["pooled"]["target"]) >= {"gain_at_least_0.20", "intervals_apart", "seeds"}
    assert all(seed["checks"].values()), seed["checks"]


def test_a_rerun_picks_up_where_the_seed_stopped(quick: tuple[Path, dict[str, Any]]) -> None:
    # As after a session's end between the last phase and the results: every phase is kept, only the
    # scoring is read again, and no `legorl run` or training starts.
    work, first = quick
    (work / "seed-1" / "result.json").unlink()
    log = work / "learning.log"
    before = log.read_text()
    out = work / "again.json"
    proc = _run_quick(work, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "$ " not in log.read_text()[len(before) :]  # no child process ran
    again = json.loads(out.read_text())
    (seed,), (kept,) = again["seeds"], first["seeds"]
    assert seed["per_task"] == kept["per_task"] and seed["seconds"] == kept["seconds"]


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
