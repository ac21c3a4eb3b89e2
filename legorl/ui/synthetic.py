"""A synthetic run store written with the real `RunStore` writers: for the UI's benchmark and tests, and to
look at the UI at scale without running anything. Rewards, outcomes and curves are random but shaped like
a run's (a rising reward, a few infra failures, a tamper finding now and then)."""

from __future__ import annotations

import math
import random
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from legorl.api.figures import EvalSummary, StepFigures
from legorl.api.store import RunStore, policy_version
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import Segment, TamperFinding, TrialRecord, routing_array

__all__ = ["write_synthetic_store"]

_REASONS = [
    (TerminationReason.COMPLETED, 0.82),
    (TerminationReason.AGENT_ERROR, 0.05),
    (TerminationReason.TURN_LIMIT, 0.05),
    (TerminationReason.AGENT_TIMEOUT, 0.03),
    (TerminationReason.SANDBOX_ERROR, 0.03),
    (TerminationReason.ENGINE_ERROR, 0.02),
]


def _segment(rng: random.Random, turns: int, tokens_per_turn: int, routing: bool, version: str) -> Segment:
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for t in range(turns):
        context = tokens_per_turn * (3 if t == 0 else 1)
        ids += [rng.randrange(4, 4000) for _ in range(context)]
        mask += [0] * context
        logprobs += [0.0] * context
        ids += [rng.randrange(4, 4000) for _ in range(tokens_per_turn)]
        mask += [1] * tokens_per_turn
        logprobs += [-abs(rng.gauss(0.0, 1.2)) for _ in range(tokens_per_turn)]
    experts = None
    if routing:
        layers, top_k = 2, 2
        rows = len(ids) - 1
        # Drawn from `rng` as before (the same store for the same seed), kept as the contract's array.
        experts = routing_array(
            [rng.randrange(8) for _ in range(rows * layers * top_k)], (rows, layers, top_k)
        )
    return Segment(
        index=0,
        token_ids=ids,
        loss_mask=mask,
        behavior_logprobs=logprobs,
        turn_indices=list(range(turns)),
        policy_versions=[version],
        routed_experts=experts,
    )


def _trial(
    rng: random.Random,
    *,
    run: str,
    trial: str,
    task: str,
    group: str,
    split: str,
    step: int,
    version: str,
    skill: float,
    started: datetime,
    tokens_per_turn: int,
    routing: bool,
) -> TrialRecord:
    roll = rng.random()
    reason = TerminationReason.COMPLETED
    for r, share in _REASONS:
        if roll < share:
            reason = r
            break
        roll -= share
    reward: float | None = None
    if reason == TerminationReason.COMPLETED:
        reward = 1.0 if rng.random() < skill else 0.0
    elif reason in (
        TerminationReason.AGENT_ERROR,
        TerminationReason.TURN_LIMIT,
        TerminationReason.AGENT_TIMEOUT,
    ):
        reward = 0.0
    turns = rng.randint(1, 4)
    stages = {
        "setup": rng.uniform(0.05, 0.5),
        "proxy_start": rng.uniform(2, 6),
        "agent_start": rng.uniform(0.2, 0.8),
        "agent": rng.uniform(10, 60),
        "verify": rng.uniform(1, 4),
    }
    tamper = []
    if rng.random() < 0.01:
        tamper.append(
            TamperFinding(
                kind="test_file_modified",
                detail="the diff touched tests/test_core.py",
                path="tests/test_core.py",
            )
        )
    return TrialRecord(
        run=run,
        trial=trial,
        task_id=task,
        group_id=group,
        split=split,  # type: ignore[arg-type]
        step=step,
        harness="MiniSweAgent",
        termination_reason=reason,
        reward=reward,
        started_at=started,
        ended_at=started + timedelta(seconds=sum(stages.values())),
        segments=[_segment(rng, turns, tokens_per_turn, routing, version)]
        if reason != TerminationReason.SANDBOX_ERROR
        else [],
        tamper_findings=tamper,
        policy_versions=[version],
        num_turns=turns,
        merged_turn_share=1.0,
        stage_seconds=stages,
        error="sandbox: pod evicted (synthetic)" if reason == TerminationReason.SANDBOX_ERROR else None,
    )


def write_synthetic_store(
    root: str | Path,
    *,
    name: str = "synthetic",
    steps: int = 100,
    tasks_per_step: int = 25,
    group_size: int = 4,
    held_out_tasks: int = 20,
    eval_every: int = 10,
    tokens_per_turn: int = 48,
    routing: bool = False,
    save_trials: bool = False,
    seed: int = 0,
) -> RunStore:
    """Write a run of `steps` × `tasks_per_step` × `group_size` training trials (plus held-out evaluations
    every `eval_every` steps) into `root`. `save_trials` also writes each trial's own file under trials/
    (as the controller's journal does); batches alone are what a finished run mostly reads from."""
    rng = random.Random(seed)  # noqa: S311 - reproducible synthetic data, not a secret
    store = RunStore(str(root))
    store.write_run_spec(
        {
            "apiVersion": "legorl.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": name},
            "spec": {
                "algorithm": {"name": "GRPO", "groupSize": group_size, "tasksPerStep": tasks_per_step},
                "stop": {"maxSteps": steps},
                "filter": {
                    "dropReasons": [
                        "cancelled",
                        "defense_failed",
                        "engine_error",
                        "proxy_error",
                        "sandbox_error",
                        "verifier_error",
                    ]
                },
            },
        }
    )
    all_tasks = [f"synthetic__task-{i:04d}" for i in range(max(tasks_per_step * 4, 8))]
    held = [f"synthetic__held-{i:03d}" for i in range(held_out_tasks)]
    clock = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
    trials_total = 0
    last_eval: EvalSummary | None = None
    baseline = None
    for step in range(0, steps + 1):
        version = policy_version(max(step - 1, 0))
        skill = 0.25 + 0.5 * (1 - math.exp(-step / max(steps / 3, 1)))
        if held and (step % eval_every == 0 or step == steps):
            records = [
                _trial(
                    rng,
                    run=name,
                    trial=f"e{step}-t{i}-r0",
                    task=task,
                    group=f"e{step}-t{i}-{task}",
                    split="validation",
                    step=step,
                    version=policy_version(step),
                    skill=skill,
                    started=clock,
                    tokens_per_turn=tokens_per_turn,
                    routing=routing,
                )
                for i, task in enumerate(held)
            ]
            for record in records:
                store.save_trial(record)
            scored = [r for r in records if r.reward is not None]
            solved = sum(1 for r in scored if (r.reward or 0) >= 1)
            rate = solved / len(scored) if scored else None
            n = max(len(scored), 1)
            p = rate or 0.0
            z = 1.96
            centre = (p + z * z / (2 * n)) / (1 + z * z / n)
            half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
            last_eval = EvalSummary(
                step=step,
                policy_version=policy_version(step),
                trials=len(records),
                scored=len(scored),
                solved=solved,
                solve_rate=rate,
                interval95=(max(0.0, centre - half), min(1.0, centre + half)),
                infra_failures=len(records) - len(scored),
                by_reason=dict(Counter(r.termination_reason.value for r in records)),
                per_task={r.task_id: float(r.reward or 0.0) for r in scored},
            )
            store.write_eval_summary(last_eval)
            if step == 0:
                baseline = rate
        if step == 0:
            continue
        tasks = rng.sample(all_tasks, tasks_per_step)
        records = []
        for t, task in enumerate(tasks):
            for replica in range(group_size):
                records.append(
                    _trial(
                        rng,
                        run=name,
                        trial=f"s{step}-t{t}-r{replica}",
                        task=task,
                        group=f"s{step}-t{t}-{task}",
                        split="train",
                        step=step,
                        version=version,
                        skill=skill,
                        started=clock,
                        tokens_per_turn=tokens_per_turn,
                        routing=routing,
                    )
                )
        clock += timedelta(minutes=3)
        if save_trials:
            for record in records:
                store.save_trial(record)
        kept = [r for r in records if r.reward is not None]
        groups: dict[str, list[float]] = {}
        for r in kept:
            groups.setdefault(r.group_id, []).append(r.reward or 0.0)
        by_reason: dict[str, int] = {}
        for r in records:
            by_reason[r.termination_reason.value] = by_reason.get(r.termination_reason.value, 0) + 1
        reward_mean = sum(r.reward or 0.0 for r in kept) / len(kept) if kept else None
        store.commit_batch(
            step,
            records,
            policy_version=version,
            meta={
                "trials": len(records),
                "kept": len(kept),
                "groups": len(groups),
                "zero_variance_groups": sum(1 for g in groups.values() if max(g) == min(g)),
                "infra_failures": len(records) - len(kept),
                "reward_mean": reward_mean,
                "by_reason": by_reason,
                "policy_versions_seen": [version],
            },
        )
        store.write_step_figures(
            StepFigures(
                step=step,
                reward_mean=reward_mean,
                entropy=0.6 * math.exp(-step / steps) + rng.uniform(0, 0.05),
                kl_ref=0.001 * step + rng.uniform(0, 0.001),
                clip_fraction=rng.uniform(0, 0.05),
                grad_norm=rng.uniform(0.5, 1.5),
                loss=rng.uniform(-0.1, 0.1),
                fidelity_pearson=0.999 - rng.uniform(0, 0.002),
                fidelity_mean_abs_logprob_delta=rng.uniform(0, 1e-3),
                fidelity_max_abs_logprob_delta=rng.uniform(0, 0.05),
                is_ess=1 - rng.uniform(0, 0.02),
                max_staleness_seen=rng.choice([0, 0, 1]),
                tokens_per_second=rng.uniform(800, 1200),
            )
        )
        trials_total += len(records)
    store.write_controller_state(
        {
            "run": name,
            "step": steps,
            "max_steps": steps,
            "policy_version": policy_version(steps),
            "trials_total": trials_total,
            "trials_running": 0,
            "eval_trials": 0,
            "trials_dropped": 0,
            "held_out_solve_rate": last_eval.solve_rate if last_eval else None,
            "held_out_interval": list(last_eval.interval95) if last_eval and last_eval.interval95 else None,
            "baseline_solve_rate": baseline,
            "trials_per_minute": 33.0,
            "message": f"trained {steps} steps (stop.maxSteps)",
            "by_reason": {},
        }
    )
    return store
