"""Diagnostics: each rule matches its failure signature and stays quiet on near misses; facts from a store."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from legorl.api.store import RunStore
from legorl.api.trajectory import Segment, TamperFinding, TerminationReason, TrialRecord, trials_to_table
from legorl.diagnostics import (
    RULES,
    EvalFacts,
    EventFacts,
    Finding,
    PodFacts,
    RunFacts,
    SpecFacts,
    StepFacts,
    TrialFacts,
    diagnose,
)
from legorl.diagnostics.rules.rollout import (
    engine_unavailable_during_sync,
    staleness_over_limit,
    zero_tool_calls,
)
from legorl.diagnostics.rules.sandbox import (
    defense_failed_spike,
    image_pull_failures,
    infra_failures,
    sandbox_start_creep,
    tamper_findings,
    zero_rewards_verify_errors,
)
from legorl.diagnostics.rules.training import (
    entropy_collapse,
    equal_reward_groups,
    fidelity_below_threshold,
    is_ess_collapse,
    updates_skipped,
)

T0 = datetime(2026, 12, 1, 0, 0, tzinfo=UTC)
INFRA = {"sandbox_error", "engine_error", "proxy_error", "verifier_error", "defense_failed", "cancelled"}


def trial(
    step: int,
    i: int,
    *,
    reason: str = "completed",
    reward: float | None = 0.0,
    group: str | None = None,
    turns: int = 3,
    tool_calls: int | None = None,
    versions: Sequence[str] | None = None,
    error: str | None = None,
    stages: dict[str, float] | None = None,
    started: datetime | None = None,
    ended: datetime | None = None,
    tamper: Sequence[str] = (),
) -> TrialFacts:
    return TrialFacts(
        trial=f"s{step}-t{i // 4}-r{i % 4}",
        step=step,
        task_id=f"task-{i // 4}",
        group_id=group or f"s{step}-g{i // 4}",
        termination_reason=reason,
        reward=None if reason in INFRA else reward,
        num_turns=turns,
        tool_calls=tool_calls,
        policy_versions=list(versions if versions is not None else [f"v{step - 1}"]),
        stage_seconds=stages or {},
        started_at=started,
        ended_at=ended,
        tamper_kinds=list(tamper),
        error=error,
    )


def trials(step: int, n: int = 16, **kw: Any) -> list[TrialFacts]:
    return [trial(step, i, **kw) for i in range(n)]


def step(
    n: int, rows: Sequence[TrialFacts] = (), metrics: dict[str, Any] | None = None, **kw: Any
) -> StepFacts:
    return StepFacts(step=n, trials=list(rows), metrics=metrics or {}, **kw)


def facts(*steps: StepFacts, spec: SpecFacts | None = None, **kw: Any) -> RunFacts:
    return RunFacts(run="r", now=T0 + timedelta(days=1), spec=spec or SpecFacts(), steps=list(steps), **kw)


def mixed(step_no: int, n: int = 16) -> list[TrialFacts]:
    """A healthy step: groups of 4 with rewards 1, 0, 1, 0."""
    return [trial(step_no, i, reward=float(i % 2)) for i in range(n)]


# --- the registry and diagnose -----------------------------------------------------------------------


def test_rules_have_unique_ids_titles_and_descriptions() -> None:
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)) >= 10
    for r in RULES:
        assert r.title and len(r.description) > 40
        assert r.id == r.id.lower() and " " not in r.id


def test_diagnose_healthy_run_finds_nothing() -> None:
    healthy = [
        step(
            s, mixed(s), {"fidelity_pearson": 0.9999, "is_ess": 0.98, "entropy": 0.7, "max_staleness_seen": 0}
        )
        for s in range(1, 6)
    ]
    assert diagnose(facts(*healthy)) == []
    assert diagnose(RunFacts()) == []


def test_diagnose_sorts_most_severe_first() -> None:
    s1 = step(1, mixed(1), {"fidelity_pearson": 0.95, "is_ess": 0.1})
    found = diagnose(facts(s1))
    assert [f.rule for f in found] == ["is-ess-collapse", "fidelity-below-threshold"]
    assert [f.severity for f in found] == ["critical", "warning"]


def test_findings_and_facts_are_json() -> None:
    s1 = step(
        1, trials(1, reason="verifier_error", error="No module named pytest"), {"fidelity_pearson": 0.5}
    )
    run = facts(s1)
    found = diagnose(run)
    assert found
    json.dumps([f.model_dump(mode="json") for f in found])
    assert RunFacts.model_validate_json(run.model_dump_json()) == run
    assert all(len(f.trials) <= 10 for f in found)


# --- zero-tool-calls ------------------------------------------------------------------------------------


def test_zero_tool_calls_recorded_is_critical() -> None:
    f = zero_tool_calls(facts(step(1, mixed(1)), step(2, trials(2, n=8, tool_calls=0))))
    assert f is not None and f.severity == "critical"
    assert f.steps == [2] and f.evidence["signal"] == "tool_calls"
    assert "8 trials" in f.summary


def test_zero_tool_calls_near_miss_one_call() -> None:
    rows = trials(1, n=8, tool_calls=0)
    rows[3] = trial(1, 3, tool_calls=1)
    assert zero_tool_calls(facts(step(1, rows))) is None


def test_zero_tool_calls_fallback_single_call() -> None:
    spec = SpecFacts(fleet_dtype="bfloat16", tool_call_parser=None)
    f = zero_tool_calls(facts(step(3, trials(3, n=8, turns=1)), spec=spec))
    assert f is not None and f.severity == "warning" and f.evidence["signal"] == "num_turns"
    assert "not recorded" in f.summary
    assert "no toolCallParser" in f.causes[0]


def test_zero_tool_calls_fallback_near_misses() -> None:
    rows = trials(1, n=8, turns=1)
    rows[0] = trial(1, 0, turns=2)
    assert zero_tool_calls(facts(step(1, rows))) is None
    # Too few trials reached the agent; infra failures do not count.
    few = trials(1, n=3, turns=1) + trials(1, n=5, reason="sandbox_error", turns=0)
    assert zero_tool_calls(facts(step(1, few))) is None
    # Every trial crashed before its first call: not a tool-call problem.
    assert zero_tool_calls(facts(step(1, trials(1, n=8, reason="agent_error", turns=0)))) is None


def test_zero_tool_calls_fallback_turn_limit() -> None:
    spec = SpecFacts(max_turns=30, tool_call_parser="hermes", fleet_dtype="auto")
    f = zero_tool_calls(facts(step(2, trials(2, n=8, reason="turn_limit", turns=30)), spec=spec))
    assert f is not None and f.evidence["signal"] == "turn_limit"
    assert "`hermes`" in f.causes[0]
    assert any("maxTurns (30)" in c for c in f.causes)


# --- fidelity -----------------------------------------------------------------------------------------


def _fid(values: Sequence[float], **extra: Any) -> list[StepFacts]:
    return [step(i + 1, metrics={"fidelity_pearson": v, **extra}) for i, v in enumerate(values)]


def test_fidelity_run_of_window_is_critical() -> None:
    f = fidelity_below_threshold(facts(*_fid([0.999, 0.97, 0.96, 0.95])))
    assert f is not None and f.severity == "critical"
    assert f.steps == [2, 3, 4] and f.evidence["longest_run"] == 3
    assert "0.9500 at step 4" in f.summary
    # The first step was fine: stale weights and the prefix cache rank above a generic dtype guess.
    assert f.causes[-1].startswith("dtype mismatch")


def test_fidelity_short_dip_is_warning_and_near_miss_is_quiet() -> None:
    f = fidelity_below_threshold(facts(*_fid([0.999, 0.97, 0.999, 0.98])))
    assert f is not None and f.severity == "warning" and f.steps == [2, 4]
    assert fidelity_below_threshold(facts(*_fid([0.9905, 0.991, 0.99]))) is None
    assert (
        fidelity_below_threshold(facts(*_fid([0.95, 0.95, 0.95]), spec=SpecFacts(min_correlation=0.9)))
        is None
    )


def test_fidelity_causes_follow_the_spec() -> None:
    dtype = SpecFacts(trainer_dtype="bfloat16", fleet_dtype="float16")
    f = fidelity_below_threshold(facts(*_fid([0.9]), spec=dtype))
    assert f is not None and f.causes[0].startswith("dtype mismatch: the fleet runs float16")
    replay_off = SpecFacts(routing_replay="Disabled", fleet_dtype="bfloat16", prefix_caching="Disabled")
    f = fidelity_below_threshold(facts(*_fid([0.9], replayed_token_share=0.0), spec=replay_off))
    assert f is not None and f.causes[0].startswith("routing replay is off")
    assert not any("prefix cache" in c for c in f.causes)
    partial = fidelity_below_threshold(facts(*_fid([0.9], replayed_token_share=0.4)))
    assert partial is not None and "40%" in partial.causes[0]


# --- zero rewards with verify errors ------------------------------------------------------------------


def test_zero_rewards_with_network_verify_errors() -> None:
    net = "pip install failed: Temporary failure in name resolution"
    rows = trials(1, n=6) + [trial(1, 6 + i, reason="verifier_error", error=net) for i in range(2)]
    f = zero_rewards_verify_errors(facts(step(1, rows)))
    assert f is not None and f.severity == "critical" and f.steps == [1]
    assert "network" in f.causes[0]
    assert f.evidence["errors"][0]["count"] == 2
    assert set(f.trials) == {"s1-t1-r2", "s1-t1-r3"}


def test_zero_rewards_missing_module_ranks_the_image_first() -> None:
    rows = trials(1, n=8, reason="verifier_error", error="ModuleNotFoundError: No module named 'pytest'")
    f = zero_rewards_verify_errors(facts(step(1, rows)))
    assert f is not None and f.causes[0].startswith("the pristine image")


def test_zero_rewards_near_misses() -> None:
    one_solved = [*trials(1, n=6), trial(1, 6, reward=1.0), trial(1, 7, reason="verifier_error")]
    assert zero_rewards_verify_errors(facts(step(1, one_solved))) is None
    assert zero_rewards_verify_errors(facts(step(1, trials(1, n=16)))) is None  # hard tasks, no errors
    rare = [*trials(1, n=31), trial(1, 31, reason="verifier_error")]  # 1 of 32: below 10%
    assert zero_rewards_verify_errors(facts(step(1, rare))) is None


def test_zero_rewards_from_evaluations() -> None:
    ev = EvalFacts(
        step=0, solve_rate=0.0, trials=10, scored=5, by_reason={"completed": 5, "verifier_error": 5}
    )
    f = zero_rewards_verify_errors(facts(evals=[ev]))
    assert f is not None and "evaluation of v0" in f.summary and f.steps == []
    fine = EvalFacts(step=0, solve_rate=0.3, trials=10, by_reason={"completed": 5, "verifier_error": 5})
    assert zero_rewards_verify_errors(facts(evals=[fine])) is None


# --- defense_failed -----------------------------------------------------------------------------------


def test_defense_failed_spike() -> None:
    err = "egress.rules ipv4: filter table differs from the lock: -A OUTPUT"
    rows = mixed(2)[:13] + [trial(2, 13 + i, reason="defense_failed", error=err) for i in range(3)]
    f = defense_failed_spike(facts(step(1, mixed(1)), step(2, rows)))
    assert f is not None and f.severity == "warning" and f.steps == [2]
    assert f.evidence["checks"] == {"egress.rules": 3}
    assert f.causes[0].startswith("the egress lock")
    history = [
        trial(1, i, reason="defense_failed", error="history.single_commit: 3 commits") for i in range(9)
    ]
    f = defense_failed_spike(facts(step(1, mixed(1)[:7] + history)))
    assert f is not None and f.severity == "critical" and "git layout" in f.causes[0]


def test_defense_failed_near_misses() -> None:
    one = [*mixed(1)[:15], trial(1, 15, reason="defense_failed")]
    assert defense_failed_spike(facts(step(1, one))) is None
    two_of_32 = mixed(1, 30) + [trial(1, 30 + i, reason="defense_failed") for i in range(2)]
    assert defense_failed_spike(facts(step(1, two_of_32))) is None


def test_defense_failed_in_an_evaluation() -> None:
    ev = EvalFacts(step=3, solve_rate=0.2, trials=20, by_reason={"completed": 14, "defense_failed": 6})
    f = defense_failed_spike(facts(evals=[ev]))
    assert f is not None and "evaluation of v3" in f.summary


# --- image pulls ----------------------------------------------------------------------------------------


def pod(
    name: str, reason: str | None, message: str = "", image: str = "reg.example/task:1"
) -> dict[str, Any]:
    state: dict[str, Any] = {"waiting": {"reason": reason, "message": message}} if reason else {"running": {}}
    return {
        "metadata": {"name": name, "namespace": "ml", "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {"nodeName": "node-a", "initContainers": [{"name": "setup", "image": image}]},
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [{"name": "setup", "image": image, "state": state, "restartCount": 0}],
        },
    }


def test_image_pull_failures_from_pods() -> None:
    msg = 'Back-off pulling image "reg.example/task:1": manifest unknown'
    run = facts(pods=[PodFacts.from_object(pod("t-1", "ImagePullBackOff", msg))])
    f = image_pull_failures(run)
    assert f is not None and f.severity == "warning"
    assert f.causes[0].startswith("the image name or tag does not exist")
    assert f.evidence["pods"][0]["image"] == "reg.example/task:1"
    many = facts(pods=[PodFacts.from_object(pod(f"t-{i}", "ErrImagePull", msg)) for i in range(3)])
    f = image_pull_failures(many)
    assert f is not None and f.severity == "critical"


def test_image_pull_failures_from_events_and_trials() -> None:
    event = {
        "type": "Warning",
        "reason": "Failed",
        "message": 'Failed to pull image "reg.example/private:2": unauthorized: authentication required',
        "involvedObject": {"kind": "Pod", "name": "t-9"},
        "count": 4,
        "lastTimestamp": "2026-12-01T01:00:00Z",
    }
    f = image_pull_failures(facts(events=[EventFacts.from_object(event)]))
    assert f is not None and "imagePullSecrets" in f.causes[0]
    assert f.evidence["images"] == {"reg.example/private:2": 4}
    err = "init container setup cannot start: ErrImagePull: rpc error: code = NotFound"
    f = image_pull_failures(
        facts(step(1, [trial(1, i, reason="sandbox_error", error=err) for i in range(3)]))
    )
    assert f is not None and f.severity == "critical" and f.steps == [1] and len(f.trials) == 3


def test_image_pull_failures_near_misses() -> None:
    normal = {"type": "Normal", "reason": "Pulled", "message": 'Successfully pulled image "x"'}
    crash = {"type": "Warning", "reason": "BackOff", "message": "Back-off restarting failed container agent"}
    run = facts(
        step(1, [trial(1, 0, reason="sandbox_error", error="OOMKilled")]),
        pods=[PodFacts.from_object(pod("t-1", None)), PodFacts.from_object(pod("t-2", "CrashLoopBackOff"))],
        events=[EventFacts.from_object(normal), EventFacts.from_object(crash)],
    )
    assert image_pull_failures(run) is None


# --- sandbox start creep --------------------------------------------------------------------------------


def creeping(n: int, hours: float, start: float, end: float, stage: str = "setup") -> list[StepFacts]:
    out = []
    for i in range(n):
        frac = i / (n - 1)
        seconds = start + (end - start) * frac
        when = T0 + timedelta(hours=hours * frac)
        out.append(trial(1 + i // 8, i, started=when, stages={stage: seconds, "agent": 100.0, "verify": 5.0}))
    steps: dict[int, list[TrialFacts]] = {}
    for t in out:
        steps.setdefault(t.step, []).append(t)
    return [step(s, rows) for s, rows in steps.items()]


def test_sandbox_start_creep() -> None:
    f = sandbox_start_creep(facts(*creeping(40, 4, 10, 80), spec=SpecFacts(pre_pull_policy="Lookahead")))
    assert f is not None and f.severity == "warning"
    assert f.evidence["late_median_seconds"] > 2 * f.evidence["early_median_seconds"]
    assert f.evidence["slope_seconds_per_hour"] > 10
    assert "`setup` stage grew most" in f.summary
    assert f.causes[0].startswith("the pre-pull covers")
    f = sandbox_start_creep(facts(*creeping(40, 6, 20, 900)))
    assert f is not None and f.severity == "critical"
    f = sandbox_start_creep(facts(*creeping(40, 4, 5, 90, stage="proxy_start")))
    assert f is not None and f.causes[0].startswith("the host is contended")


def test_sandbox_start_creep_near_misses() -> None:
    assert sandbox_start_creep(facts(*creeping(40, 0.5, 10, 80))) is None  # under an hour
    assert sandbox_start_creep(facts(*creeping(40, 4, 10, 25))) is None  # +15 s only
    assert sandbox_start_creep(facts(*creeping(40, 4, 60, 100))) is None  # less than doubled
    assert sandbox_start_creep(facts(*creeping(12, 4, 10, 80))) is None  # too few trials


# --- importance-sampling ESS ----------------------------------------------------------------------------


def test_is_ess_collapse() -> None:
    f = is_ess_collapse(facts(step(1, metrics={"is_ess": 0.9}), step(2, metrics={"is_ess": 0.3})))
    assert f is not None and f.severity == "warning" and f.steps == [2]
    f = is_ess_collapse(facts(step(1, metrics={"is_ess": 0.1, "fidelity_pearson": 0.9})))
    assert f is not None and f.severity == "critical"
    assert f.causes[0].startswith("rollout and training probabilities disagree")
    assert not any("topP" in c for c in f.causes)
    f = is_ess_collapse(facts(step(1, metrics={"is_ess": 0.4}), spec=SpecFacts(top_p=0.9)))
    assert f is not None and f.causes[0].startswith("sampling.topP 0.9")


def test_is_ess_near_miss() -> None:
    assert (
        is_ess_collapse(facts(step(1, metrics={"is_ess": 0.55}), step(2, metrics={"is_ess": None}))) is None
    )


# --- equal-reward groups --------------------------------------------------------------------------------


def test_equal_reward_groups_all_zero_is_critical() -> None:
    f = equal_reward_groups(facts(*(step(s, trials(s, n=16)) for s in (1, 2, 3))))
    assert f is not None and f.severity == "critical" and f.steps == [1, 2, 3]
    assert f.causes[0].startswith("the tasks are too hard")
    assert "12 of 12 groups" in f.summary and "12 all failed" in f.summary


def test_equal_reward_groups_mostly_solved_is_warning() -> None:
    def three_quarters(s: int) -> list[TrialFacts]:
        rows = trials(s, n=16, reward=1.0)
        rows[0] = trial(s, 0, reward=0.0)  # group 0 varies, groups 1-3 all solved
        return rows

    f = equal_reward_groups(facts(step(1, mixed(1)), step(2, three_quarters(2)), step(3, three_quarters(3))))
    assert f is not None and f.severity == "warning" and f.steps == [2, 3]
    assert f.causes[0].startswith("the tasks are too easy")


def test_equal_reward_groups_near_misses() -> None:
    def half(s: int) -> list[TrialFacts]:
        return trials(s, n=8) + mixed(s)[8:]

    all_equal = [step(s, trials(s, n=16)) for s in (1, 3)]
    assert equal_reward_groups(facts(all_equal[0], step(2, half(2)), all_equal[1])) is None
    assert equal_reward_groups(facts(step(1, trials(1)))) is None  # a single step
    # Infra failures are dropped: what is left of each group still varies.
    rows = mixed(1)
    rows[1] = trial(1, 1, reason="engine_error")
    assert equal_reward_groups(facts(step(1, rows), step(2, mixed(2)))) is None


def test_equal_reward_groups_from_commit_meta() -> None:
    meta = {"groups": 4, "zero_variance_groups": 4}
    f = equal_reward_groups(facts(step(1, meta=meta), step(2, meta=meta)))
    assert f is not None and f.steps == [1, 2]


# --- staleness --------------------------------------------------------------------------------------------


def test_staleness_sync_mode() -> None:
    rows = mixed(3)[:12] + [trial(3, 12 + i, versions=["v1", "v2"]) for i in range(4)]
    f = staleness_over_limit(
        facts(step(2, mixed(2)), step(3, rows, {"dropped_stale": 4, "max_staleness_seen": 1}))
    )
    assert f is not None and f.severity == "warning" and f.steps == [3]
    assert f.evidence["per_step"][0]["stale"] == 4 and f.evidence["limit"] == 0
    assert "weight sync failed" in f.causes[0]


def test_staleness_async_limit_and_near_misses() -> None:
    spec = SpecFacts(schedule_mode="Async", max_staleness_steps=1)
    ok = step(3, trials(3, versions=["v1"]))  # one behind: within the limit
    assert staleness_over_limit(facts(ok, spec=spec)) is None
    assert staleness_over_limit(facts(step(3, mixed(3)))) is None  # sync, current version
    stale = step(3, trials(3, versions=["v0", "v1"]))
    f = staleness_over_limit(facts(stale, spec=spec))
    assert f is not None and f.severity == "critical" and "up to 2 behind" in f.summary
    only_metric = step(5, metrics={"max_staleness_seen": 3, "dropped_stale": 1, "trials_total": 16})
    f = staleness_over_limit(facts(only_metric, spec=spec))
    assert f is not None and f.severity == "warning" and f.evidence["per_step"][0]["max_staleness"] == 3


def test_staleness_unknown_versions() -> None:
    f = staleness_over_limit(facts(step(2, trials(2, n=8, versions=["unknown"]))))
    assert f is not None and "`unknown`" in f.causes[0] and "8 trials carry" in f.summary
    # Infra failures are never trained on: their versions do not matter.
    assert (
        staleness_over_limit(facts(step(2, trials(2, n=8, reason="sandbox_error", versions=["v0"])))) is None
    )


# --- engine errors during weight syncs ---------------------------------------------------------------------


def _sync_run(offsets: Sequence[float], *, pause: str | None = None, error: str | None = None) -> RunFacts:
    published = T0 + timedelta(hours=1)
    synced = step(2, mixed(2), {"sync_seconds": 90.0}, published_at=published)
    failed = [
        trial(3, i, reason="engine_error", ended=published + timedelta(seconds=o), error=error)
        for i, o in enumerate(offsets)
    ]
    rows = failed + mixed(3)[len(failed) :]
    return facts(step(1, mixed(1)), synced, step(3, rows), spec=SpecFacts(weight_sync_pause_mode=pause))


def test_engine_errors_during_sync() -> None:
    err = "the engine stayed unavailable for 120s (HTTP 503)"
    f = engine_unavailable_during_sync(_sync_run([30, 100, 200, 250], error=err))
    assert f is not None and f.severity == "critical" and f.steps == [3]
    assert f.evidence["during_sync"] == 4 and f.evidence["mention_unavailable"] == 4
    assert f.evidence["syncs"][0]["version"] == "v2"
    assert "slow sync" in f.causes[0]
    f = engine_unavailable_during_sync(_sync_run([10, 20, 30], pause="Abort"))
    assert (
        f is not None and f.severity == "warning" and f.causes[0].startswith("weightSync.pauseMode is Abort")
    )


def test_engine_errors_during_sync_near_misses() -> None:
    assert engine_unavailable_during_sync(_sync_run([3600, 3700, 3800])) is None  # long after the sync
    assert engine_unavailable_during_sync(_sync_run([10, 20])) is None  # only two
    assert engine_unavailable_during_sync(_sync_run([-60, 400, 500])) is None  # before and after the window


def test_engine_errors_across_a_swap_without_publication_times() -> None:
    rows = [trial(4, i, reason="engine_error", versions=["v2", "v3"]) for i in range(3)]
    f = engine_unavailable_during_sync(facts(step(4, rows + mixed(4)[3:])))
    assert f is not None and f.evidence["syncs"] == []


# --- skipped updates, entropy ---------------------------------------------------------------------------


def test_updates_skipped() -> None:
    f = updates_skipped(
        facts(step(1, metrics={"loss": 0.1}), step(2, metrics={"skipped": "non-finite gradient norm (nan)"}))
    )
    assert f is not None and f.severity == "critical" and f.causes[0].startswith("the loss or its gradient")
    f = updates_skipped(
        facts(step(1, metrics={"skipped": "no trials left after filtering"}), step(2, metrics={"loss": 0.1}))
    )
    assert f is not None and f.severity == "warning" and f.causes[0].startswith("every trial was filtered")
    assert updates_skipped(facts(step(1, metrics={"loss": 0.1}))) is None


def test_entropy_collapse() -> None:
    series = [1.0, 0.9, 1.1, 0.5, 0.15]
    f = entropy_collapse(facts(*(step(i + 1, metrics={"entropy": v}) for i, v in enumerate(series))))
    assert f is not None and f.steps == [5] and f.evidence["baseline"] == 1.0
    calm = [1.0, 0.9, 1.1, 0.3]
    assert entropy_collapse(facts(*(step(i + 1, metrics={"entropy": v}) for i, v in enumerate(calm)))) is None
    short = [1.0, 0.01, 0.01]
    assert (
        entropy_collapse(facts(*(step(i + 1, metrics={"entropy": v}) for i, v in enumerate(short)))) is None
    )


# --- tamper findings, infra failures ----------------------------------------------------------------------


def test_tamper_findings() -> None:
    rows = mixed(2)[:13] + [trial(2, 13 + i, reward=1.0, tamper=["test_hook_added"]) for i in range(3)]
    f = tamper_findings(facts(step(1, mixed(1)), step(2, rows)))
    assert f is not None and f.severity == "warning" and f.evidence["kinds"] == {"test_hook_added": 3}
    assert f.causes[0].startswith("the policy is learning to game")
    tests_only = mixed(1)[:14] + [trial(1, 14 + i, tamper=["test_file_modified"]) for i in range(2)]
    f = tamper_findings(facts(step(1, tests_only)))
    assert f is not None and "false positive" in f.causes[0]
    one = [*mixed(1)[:15], trial(1, 15, tamper=["symlink"])]
    assert tamper_findings(facts(step(1, one))) is None


def test_infra_failures() -> None:
    rows = mixed(1)[:11] + [trial(1, 11 + i, reason="sandbox_error", error="OOMKilled") for i in range(5)]
    f = infra_failures(facts(step(1, rows)))
    assert f is not None and f.severity == "warning" and f.causes[0].startswith("sandboxes fail")
    rows = mixed(1)[:7] + [trial(1, 7 + i, reason="engine_error") for i in range(9)]
    f = infra_failures(facts(step(1, rows)))
    assert f is not None and f.severity == "critical"
    rows = mixed(1)[:13] + [trial(1, 13 + i, reason="sandbox_error") for i in range(3)]
    assert infra_failures(facts(step(1, rows))) is None


# --- facts from objects and specs -----------------------------------------------------------------------


def test_spec_facts_from_run() -> None:
    assert SpecFacts.from_run(None) == SpecFacts()
    assert SpecFacts().staleness_limit == 0
    spec = SpecFacts.from_run(
        {
            "spec": {
                "fidelity": {"minCorrelation": "0.995", "windowSteps": 5},
                "schedule": {"mode": "Async", "maxStalenessSteps": 2},
                "algorithm": {"groupSize": 16, "sampling": {"topP": "0.95", "temperature": "bogus"}},
                "trainer": {"dtype": "bfloat16", "routingReplay": "Enabled"},
                "fleet": {"settings": {"dtype": "float16", "toolCallParser": "qwen3_coder"}},
                "pool": {"prePull": {"policy": "Lookahead"}, "runtimeClassName": "gvisor"},
                "harness": {"kind": "ClaudeCode", "maxTurns": 50},
            }
        }
    )
    assert (spec.min_correlation, spec.window_steps, spec.staleness_limit) == (0.995, 5, 2)
    assert (spec.group_size, spec.top_p, spec.temperature) == (16, 0.95, 1.0)
    assert (spec.fleet_dtype, spec.tool_call_parser, spec.routed_experts_capture) == (
        "float16",
        "qwen3_coder",
        "Enabled",
    )
    assert (spec.pre_pull_policy, spec.runtime_class_name, spec.harness, spec.max_turns) == (
        "Lookahead",
        "gvisor",
        "ClaudeCode",
        50,
    )
    shared = SpecFacts.from_run({"spec": {"fleetRef": {"name": "f"}}})
    assert shared.fleet_dtype is None and shared.prefix_caching is None


def test_event_facts_from_events_v1() -> None:
    event = EventFacts.from_object(
        {
            "reason": "ErrImagePull",
            "note": "pull failed",
            "type": "Warning",
            "regarding": {"kind": "Pod", "name": "p"},
            "series": {"count": 7, "lastObservedTime": "2026-12-01T02:00:00Z"},
        }
    )
    assert (event.message, event.kind, event.count) == ("pull failed", "Pod", 7)
    assert event.last_seen == T0 + timedelta(hours=2)


# --- RunFacts.from_store against a real run store ---------------------------------------------------------


def record(
    name: str,
    step: int,
    *,
    reason: TerminationReason = TerminationReason.COMPLETED,
    reward: float | None = 0.0,
    error: str | None = None,
    tamper: bool = False,
) -> TrialRecord:
    seg = Segment(
        index=0,
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        behavior_logprobs=[0.0, 0.0, -0.5, -1.25],
        turn_indices=[0, 1],
        policy_versions=[f"v{step - 1}"],
    )
    started = T0 + timedelta(minutes=10 * step)
    return TrialRecord(
        run="diag",
        trial=name,
        task_id=f"task-{name[-3]}",
        group_id=f"s{step}-g{name[-3]}",
        split="train",
        step=step,
        harness="MiniSweAgent",
        termination_reason=reason,
        reward=reward,
        started_at=started,
        ended_at=started + timedelta(minutes=3),
        segments=[seg] if reward is not None else [],
        tamper_findings=[TamperFinding(kind="test_hook_added", detail="conftest.py", path="conftest.py")]
        if tamper
        else [],
        policy_versions=[f"v{step - 1}"],
        num_turns=2,
        stage_seconds={"setup": 1.5, "proxy_start": 2.0, "agent": 40.0, "verify": 3.0},
        error=error,
    )


RUN = {
    "apiVersion": "legorl.dev/v1alpha1",
    "kind": "RLRun",
    "metadata": {"name": "diag"},
    "spec": {"fidelity": {"minCorrelation": "0.99", "windowSteps": 2}, "algorithm": {"groupSize": 4}},
}


def make_store(tmp_path: Path) -> RunStore:
    store = RunStore(tmp_path / "store")
    store.write_run_spec(RUN)
    broken = "ModuleNotFoundError: No module named 'pytest'"
    for s in (1, 2):
        batch = [record(f"s{s}-t{t}-r{r}", s) for t in range(2) for r in range(3)]
        batch += [
            record(f"s{s}-t2-r{r}", s, reason=TerminationReason.VERIFIER_ERROR, reward=None, error=broken)
            for r in range(2)
        ]
        store.commit_batch(
            s, batch, policy_version=f"v{s - 1}", meta={"groups": 2, "zero_variance_groups": 2}
        )
        store.write_metrics(
            s,
            {
                "fidelity_pearson": 0.97,
                "is_ess": 0.9,
                "sync_seconds": 1.5,
                "dropped_by_reason.verifier_error": 2,
            },
        )
        data = f"weights of v{s}".encode()
        store.write_object(f"weights/v{s}/model.safetensors", data)
        store.record_weights(f"v{s}", s, hashlib.sha256(data).hexdigest())
    # Step 3 is still collecting trials.
    store.save_trial(record("s3-t0-r0", 3, reward=1.0, tamper=True))
    store.save_trial(
        record("s3-t0-r1", 3, reason=TerminationReason.SANDBOX_ERROR, reward=None, error="OOMKilled")
    )
    store.write_eval(0, {"solve_rate": 0.0, "trials": 4, "scored": 4, "by_reason": {"completed": 4}})
    return store


def test_facts_from_store(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    now = T0 + timedelta(hours=5)
    run = RunFacts.from_store(store, now=now)
    assert run.run == "diag" and run.now == now
    assert run.spec.window_steps == 2 and run.spec.group_size == 4
    assert [(s.step, s.committed, len(s.trials)) for s in run.steps] == [
        (1, True, 8),
        (2, True, 8),
        (3, False, 2),
    ]
    one = run.steps[0]
    assert one.policy_version == "v0" and one.meta["zero_variance_groups"] == 2
    assert one.metric("fidelity_pearson") == 0.97 and one.metrics["dropped_by_reason.verifier_error"] == 2
    assert one.published_at is not None and run.steps[2].published_at is None
    t = next(t for t in one.trials if t.trial == "s1-t2-r0")
    assert (t.termination_reason, t.reward, t.error) == (
        "verifier_error",
        None,
        "ModuleNotFoundError: No module named 'pytest'",
    )
    assert t.start_seconds == 3.5 and t.stage_seconds["agent"] == 40.0 and t.tool_calls is None
    assert t.started_at == T0 + timedelta(minutes=10) and t.policy_versions == ["v0"] and t.num_turns == 2
    assert run.steps[2].trials[0].tamper_kinds == ["test_hook_added"]
    assert run.evals == [EvalFacts(step=0, solve_rate=0.0, trials=4, scored=4, by_reason={"completed": 4})]
    found = {f.rule: f for f in diagnose(run)}
    assert found["fidelity-below-threshold"].severity == "critical"  # 2 steps, window 2
    assert found["zero-rewards-verify-errors"].steps == [1, 2]
    assert "pristine image" in found["zero-rewards-verify-errors"].causes[0]
    assert found["equal-reward-groups"].steps == [1, 2]
    assert isinstance(found["infra-failures"], Finding)


def test_facts_from_store_with_run_and_cluster_objects(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    run = {**RUN, "spec": {"fidelity": {"minCorrelation": "0.9"}}}
    msg = 'Failed to pull image "reg.example/task:1": toomanyrequests: rate limit'
    event = {
        "type": "Warning",
        "reason": "Failed",
        "message": msg,
        "involvedObject": {"kind": "Pod", "name": "t-1"},
    }
    facts_ = RunFacts.from_store(store, run=run, pods=[pod("t-1", "ImagePullBackOff", msg)], events=[event])
    assert facts_.spec.min_correlation == 0.9
    assert facts_.pods[0].containers[0].waiting_reason == "ImagePullBackOff"
    assert facts_.pods[0].node == "node-a" and facts_.pods[0].containers[0].init
    found = {f.rule: f for f in diagnose(facts_)}
    assert "fidelity-below-threshold" not in found
    assert "rate-limits" in found["image-pull-failures"].causes[0]


def test_recorded_tool_call_counts_make_the_rule_exact(tmp_path: Path) -> None:
    """Trial records carry `tool_call_turns` (the proxy's count of turns the engine answered with parsed
    tool calls): a batch of trials with none is critical, whatever shape the trials took; a batch
    committed before the column existed still reads (as unknown)."""
    store = RunStore(tmp_path / "store")
    store.write_run_spec(RUN)
    # Three turns each (not a fallback shape): only the counts can tell that no call was ever parsed.
    silent = [
        dataclasses.replace(record(f"s1-t{t}-r{r}", 1), num_turns=3, tool_call_turns=0)
        for t in range(2)
        for r in range(3)
    ]
    store.commit_batch(1, silent, policy_version="v0")
    calling = [
        dataclasses.replace(t, step=2, tool_call_turns=2, trial=t.trial.replace("s1", "s2")) for t in silent
    ]
    store.commit_batch(2, calling, policy_version="v1")
    run = RunFacts.from_store(store)
    assert [t.tool_calls for t in run.steps[0].trials] == [0] * 6
    found = {f.rule: f for f in diagnose(run)}
    assert found["zero-tool-calls"].severity == "critical" and found["zero-tool-calls"].steps == [1]

    # Trials saved by an older legorl (step 3, still collecting): no such column; facts say "unknown".
    for t in silent:
        older = trials_to_table([dataclasses.replace(t, step=3, trial=t.trial.replace("s1", "s3"))])
        sink = io.BytesIO()
        pq.write_table(older.drop_columns(["tool_call_turns"]), sink)
        store.write_object(f"trials/train/step-000003/{t.trial.replace('s1', 's3')}.parquet", sink.getvalue())
    again = RunFacts.from_store(store)
    assert [(s.step, s.committed) for s in again.steps] == [(1, True), (2, True), (3, False)]
    assert {t.tool_calls for t in again.steps[2].trials} == {None}
    # Step 3's trials made three model calls each, not a fallback shape: no guess either way.
    assert [f.steps for f in diagnose(again) if f.rule == "zero-tool-calls"] == [[1]]


def test_facts_from_an_empty_store(tmp_path: Path) -> None:
    run = RunFacts.from_store(RunStore(tmp_path / "empty"))
    assert run.steps == [] and run.evals == [] and run.run == ""
    assert diagnose(run) == []
