"""Rules about sandboxes and verification: defenses, image pulls, start times, the verifier, tampering."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Final

from legorl.api.termination import INFRA_REASONS, TerminationReason
from legorl.diagnostics._util import common_errors, median, mentions, pct, ranked, steps_phrase
from legorl.diagnostics.facts import AGENT_STAGES, RunFacts, TrialFacts
from legorl.diagnostics.finding import Finding, finding, rule

R = TerminationReason

MIN_TRIALS: Final = 4

VERIFY_ERROR_SHARE: Final = 0.10
"""Share of a step's trials ending `verifier_error` that, with no positive reward, matches."""

DEFENSE_SHARE: Final = 0.10
DEFENSE_MIN: Final = 2
DEFENSE_CRITICAL_SHARE: Final = 0.5

PULL_REASONS: Final = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
"""Kubelet waiting reasons of a container whose image cannot be pulled."""
PULL_CRITICAL: Final = 3

CREEP_MIN_TRIALS: Final = 20
CREEP_MIN_SPAN_SECONDS: Final = 3600.0
CREEP_RATIO: Final = 2.0
CREEP_MIN_INCREASE_SECONDS: Final = 30.0
CREEP_CRITICAL_INCREASE_SECONDS: Final = 600.0

TAMPER_SHARE: Final = 0.05
TAMPER_MIN: Final = 2

INFRA_WARNING_SHARE: Final = 0.25

_NETWORK = (
    "could not resolve",
    "temporary failure in name resolution",
    "name or service not known",
    "network is unreachable",
    "no route to host",
    "connection refused",
    "failed to establish a new connection",
    "getaddrinfo",
    "max retries exceeded",
    "connectionerror",
    "urlopen error",
    "pip install",
    "npm err",
    "could not fetch",
)
_MISSING = ("modulenotfounderror", "no module named", "command not found", "importerror", "no such file")
_TIMEOUT = ("timed out", "timeout", "deadline")
_PATCH = ("does not apply", "patch failed", "git apply", "corrupt patch")


def _evals_phrase(evals: list[dict[str, int]]) -> str:
    versions = ", ".join(f"v{e['step']}" for e in evals)
    return f"the evaluation{'s' if len(evals) > 1 else ''} of {versions}"


def _agent_steps(facts: RunFacts) -> list[tuple[int, list[TrialFacts]]]:
    return [(s.step, s.trials) for s in facts.steps if s.trials]


@rule("zero-rewards-verify-errors", "All rewards zero, with verifier errors")
def zero_rewards_verify_errors(facts: RunFacts) -> Finding | None:
    """A step (or held-out evaluation) where no trial earned a positive reward and ≥ 10% of the trials
    ended as `verifier_error` (≥ 4 trials in all): verification itself looks broken. Critical. The
    trials' errors rank the causes (network words, missing modules, timeouts, patches that do not
    apply)."""
    hit_steps: list[int] = []
    bad: list[TrialFacts] = []
    rows = []
    for step, trials in _agent_steps(facts):
        verr = [t for t in trials if t.termination_reason == R.VERIFIER_ERROR]
        rewarded = [t.reward for t in trials if t.reward is not None]
        if len(trials) < MIN_TRIALS or not verr or len(verr) < VERIFY_ERROR_SHARE * len(trials):
            continue
        if rewarded and max(rewarded) > 0:
            continue
        hit_steps.append(step)
        bad += verr
        rows.append(
            {"step": step, "trials": len(trials), "verifier_error": len(verr), "rewarded": len(rewarded)}
        )
    evals = [
        {"step": e.step, "trials": e.trials, "verifier_error": e.by_reason.get(R.VERIFIER_ERROR.value, 0)}
        for e in facts.evals
        if e.trials >= MIN_TRIALS
        and not e.solve_rate
        and e.by_reason.get(R.VERIFIER_ERROR.value, 0) >= max(1, VERIFY_ERROR_SHARE * e.trials)
    ]
    if not hit_steps and not evals:
        return None
    errors = [t.error for t in bad]
    causes = ranked(
        [
            (
                1.0 + mentions(errors, *_NETWORK),
                "the verifier needs the network (a pip/npm install or download during the tests) but "
                "verification runs with no egress",
            ),
            (
                0.9 + mentions(errors, *_MISSING),
                "the pristine image lacks what the tests need (dependencies, the test runner, fixtures)",
            ),
            (
                0.5 + mentions(errors, *_TIMEOUT),
                "verification runs past its deadline (the pool's deadlines.verifySeconds)",
            ),
            (
                0.4 + mentions(errors, *_PATCH),
                "the agent's diff or the hidden tests do not apply to the pristine image",
            ),
        ]
    )
    where = [steps_phrase(hit_steps)] if hit_steps else []
    if evals:
        where.append(_evals_phrase(evals))
    n_verr = len(bad) + sum(int(e["verifier_error"]) for e in evals)
    return finding(
        zero_rewards_verify_errors,
        "critical",
        f"No trial earned a reward in {' and '.join(where)}, and {n_verr} trials ended as verifier_error.",
        causes,
        "Run the task's verifier by hand in its pristine image with the gold patch and the network off, "
        "as verification runs; the example trials' errors say where it stops.",
        evidence={"per_step": rows, "evals": evals, "errors": common_errors(bad)},
        steps=hit_steps,
        trials=[t.trial for t in bad],
    )


_CHECK = re.compile(r"\b((?:egress|history|tests)\.[a-z_]+)")


@rule("defense-failed-spike", "Defense self-tests failing")
def defense_failed_spike(facts: RunFacts) -> Finding | None:
    """A step (or evaluation) where ≥ 10% and ≥ 2 of the trials ended `defense_failed`: a staged
    defense could not be applied or its self-test failed, so those trials were never trained on.
    Critical at ≥ 50%. The failing self-tests (`egress.*`, `history.*`, `tests.*`) are read from the
    trials' errors."""
    rows = []
    failed: list[TrialFacts] = []
    critical = False
    for step, trials in _agent_steps(facts):
        hit = [t for t in trials if t.termination_reason == R.DEFENSE_FAILED]
        if len(hit) >= DEFENSE_MIN and len(hit) >= DEFENSE_SHARE * len(trials):
            rows.append({"step": step, "trials": len(trials), "defense_failed": len(hit)})
            failed += hit
            critical = critical or len(hit) >= DEFENSE_CRITICAL_SHARE * len(trials)
    evals = []
    for e in facts.evals:
        n = e.by_reason.get(R.DEFENSE_FAILED.value, 0)
        if e.trials and n >= DEFENSE_MIN and n >= DEFENSE_SHARE * e.trials:
            evals.append({"step": e.step, "trials": e.trials, "defense_failed": n})
            critical = critical or n >= DEFENSE_CRITICAL_SHARE * e.trials
    if not rows and not evals:
        return None
    checks = Counter(name for t in failed for name in set(_CHECK.findall(t.error or "")))
    families = Counter(name.split(".")[0] for name in checks.elements())
    runtime = facts.spec.runtime_class_name
    causes = ranked(
        [
            (
                1.0 + families["egress"],
                "the egress lock cannot be applied or verified on these nodes (iptables/nftables missing "
                "or different under the runtime"
                + (f" `{runtime}`" if runtime else "")
                + ", IPv6 rules, a network plugin in the way)",
            ),
            (
                0.8 + families["history"],
                "the task images' git layout defeats the history reduction (packed refs, submodules, "
                "worktrees, remotes left behind)",
            ),
            (
                0.6 + families["tests"],
                "hidden tests are still in the workspace after setup (the task's test paths do not match "
                "its files)",
            ),
            (
                0.9,
                "a node, kernel or runtime change (runtimeClass, user namespaces, seccomp) broke a self-test",
            ),
        ]
    )
    n = len(failed) + sum(int(e["defense_failed"]) for e in evals)
    steps = [int(r["step"]) for r in rows]
    where = [steps_phrase(steps)] if steps else []
    if evals:
        where.append(_evals_phrase(evals))
    return finding(
        defense_failed_spike,
        "critical" if critical else "warning",
        f"{n} trials ended as defense_failed in {' and '.join(where)}"
        + (
            f"; failing self-tests: {', '.join(f'{k} ×{v}' for k, v in checks.most_common(3))}"
            if checks
            else ""
        )
        + ".",
        causes,
        "Read which self-test failed in the example trials' errors and the SandboxPool's defense "
        "self-test status, and check whether the failures share nodes; defenses fail closed, so these "
        "trials were dropped, not trained on.",
        evidence={"per_step": rows, "evals": evals, "checks": dict(checks), "errors": common_errors(failed)},
        steps=steps,
        trials=[t.trial for t in failed],
    )


_IMAGE = re.compile(r'image "?([^\s"]+)"?')
_PULL_WORDS = ("pull", "image")


@rule("image-pull-failures", "Images cannot be pulled")
def image_pull_failures(facts: RunFacts) -> Finding | None:
    """Pods with a container waiting in ErrImagePull, ImagePullBackOff, InvalidImageName or
    ErrImageNeverPull, Warning events about failed pulls, or trials whose error names those reasons.
    Critical with ≥ 3 pods or trials; the kubelet's messages rank the causes."""
    pods = []
    for pod in facts.pods:
        for c in pod.containers:
            if c.waiting_reason in PULL_REASONS:
                pods.append(
                    {
                        "pod": pod.name,
                        "node": pod.node,
                        "container": c.name,
                        "image": c.image,
                        "reason": c.waiting_reason,
                        "message": (c.waiting_message or "")[:300],
                    }
                )
    events = [
        e
        for e in facts.events
        if e.reason in PULL_REASONS
        or (e.reason in ("Failed", "BackOff") and mentions([e.message], *_PULL_WORDS) and e.type == "Warning")
    ]
    trials = [t for t in facts.trials() if mentions([t.error], *PULL_REASONS, "pulling image", "pull image")]
    if not pods and not events and not trials:
        return None
    texts = [str(p["message"]) for p in pods] + [e.message for e in events] + [t.error or "" for t in trials]
    reasons = Counter(str(p["reason"]) for p in pods) + Counter(
        e.reason for e in events if e.reason in PULL_REASONS
    )
    images = Counter(str(p["image"]) for p in pods if p["image"])
    for e in events:
        found = _IMAGE.search(e.message)
        if found:
            images[found.group(1)] += e.count
    causes = ranked(
        [
            (
                1.0 + mentions(texts, "not found", "manifest unknown", "does not exist", "name unknown"),
                "the image name or tag does not exist: the task image was not built or pushed, or the task "
                "set names another registry",
            ),
            (
                0.9 + mentions(texts, "unauthorized", "authentication required", "denied", "forbidden"),
                "the registry refuses the nodes: imagePullSecrets missing or wrong (the pool's or run's "
                "identity)",
            ),
            (
                0.5 + mentions(texts, "toomanyrequests", "rate limit", "429"),
                "the registry rate-limits the pulls: pre-pull the images (prePull All or Lookahead) or use "
                "a mirror",
            ),
            (
                0.5
                + mentions(
                    texts, "i/o timeout", "dial tcp", "no such host", "tls handshake", "deadline exceeded"
                ),
                "the nodes cannot reach the registry (network, proxy, DNS)",
            ),
            (
                0.3 + mentions(texts, "no space left"),
                "the nodes' disks are full: image garbage collection cannot keep up with many task images",
            ),
            (
                0.2 + reasons["InvalidImageName"] + mentions(texts, "InvalidImageName"),
                "an image reference is malformed (InvalidImageName)",
            ),
            (
                0.2 + reasons["ErrImageNeverPull"] + mentions(texts, "ErrImageNeverPull"),
                "pullPolicy Never and the image is not on the node (the pre-pull did not reach it)",
            ),
        ]
    )
    count = len(pods) + len(trials)
    return finding(
        image_pull_failures,
        "critical" if count >= PULL_CRITICAL else "warning",
        f"{len(pods)} pods wait on image pulls, {len(events)} pull-failure events, {len(trials)} trials "
        f"failed on a pull"
        + (f"; most affected image: {images.most_common(1)[0][0]}" if images else "")
        + ".",
        causes,
        "`kubectl describe` one of the pods in the evidence and fetch the image reference by hand (e.g. "
        "`crane manifest`) with the pool's pull secret; the SandboxPool's status lists pull failures per "
        "node.",
        evidence={
            "pods": pods[:10],
            "events": [
                {
                    "reason": e.reason,
                    "object": f"{e.kind}/{e.name}",
                    "count": e.count,
                    "message": e.message[:300],
                }
                for e in events[:10]
            ],
            "images": dict(images.most_common(10)),
            "reasons": dict(reasons),
        },
        steps=sorted({t.step for t in trials}),
        trials=[t.trial for t in trials],
    )


def _stage_medians(points: list[TrialFacts]) -> dict[str, float]:
    stages = {k for t in points for k in t.stage_seconds if k not in AGENT_STAGES}
    out = {}
    for stage in sorted(stages):
        m = median([t.stage_seconds[stage] for t in points if stage in t.stage_seconds])
        if m is not None:
            out[stage] = m
    return out


@rule("sandbox-start-creep", "Sandbox start time creeping up")
def sandbox_start_creep(facts: RunFacts) -> Finding | None:
    """Sandbox start time (the stages before the agent: setup, proxy and agent start; on pods `setup`
    runs from pod start to agent start, so it holds scheduling and image pulls) over ≥ 20 trials that
    span ≥ 1 hour: the latest quarter's median ≥ 2× the earliest quarter's and ≥ 30 s more. Critical
    when it grew by ≥ 10 minutes."""
    points = sorted(
        (t for t in facts.trials() if t.started_at is not None and t.start_seconds is not None),
        key=lambda t: t.started_at or facts.now,
    )
    if len(points) < CREEP_MIN_TRIALS:
        return None
    first, last = points[0].started_at, points[-1].started_at
    assert first is not None and last is not None
    span = (last - first).total_seconds()
    if span < CREEP_MIN_SPAN_SECONDS:
        return None
    quarter = max(5, len(points) // 4)
    early, late = points[:quarter], points[-quarter:]
    e = median([t.start_seconds or 0.0 for t in early]) or 0.0
    l_ = median([t.start_seconds or 0.0 for t in late]) or 0.0
    if l_ < CREEP_RATIO * e or l_ - e < CREEP_MIN_INCREASE_SECONDS:
        return None
    # Least-squares slope of start seconds over hours since the first trial.
    xs = [((t.started_at or first) - first).total_seconds() / 3600 for t in points]
    ys = [t.start_seconds or 0.0 for t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    early_stages, late_stages = _stage_medians(early), _stage_medians(late)
    growth = {k: late_stages[k] - early_stages.get(k, 0.0) for k in late_stages}
    grown = max(growth, key=lambda k: growth[k]) if growth else None
    prepull = facts.spec.pre_pull_policy
    causes = ranked(
        [
            (
                2.0 if grown == "setup" else 1.0,
                "the nodes' image caches are evicted (kubelet image garbage collection under disk "
                "pressure), so trials pull their images again",
            ),
            (
                2.5 if grown == "setup" and prepull in ("Lookahead", "Never") else 0.5,
                f"the pre-pull covers fewer images than the run uses (prePull {prepull or 'policy'}: a "
                "lookahead window too small, or Never)",
            ),
            (
                2.0 if grown == "proxy_start" else 0.7,
                "the host is contended: concurrent trials and the engine compete for CPU and disk",
            ),
            (
                0.9,
                "something accumulates on the nodes (leaked sandboxes, mounts or processes of cancelled "
                "trials)",
            ),
            (
                0.8 if grown == "setup" else 0.3,
                "pods wait longer to be scheduled (the cluster fills up with other workloads)",
            ),
        ]
    )
    increase = l_ - e
    return finding(
        sandbox_start_creep,
        "critical" if increase >= CREEP_CRITICAL_INCREASE_SECONDS else "warning",
        f"Median sandbox start time rose from {e:.1f} s (first {quarter} trials) to {l_:.1f} s (last "
        f"{quarter}) over {span / 3600:.1f} h, about {slope:+.1f} s per hour"
        + (f"; the `{grown}` stage grew most" if grown else "")
        + ".",
        causes,
        "Check which stage grew (evidence) and, on a cluster, the nodes' disk pressure and image "
        "garbage-collection events (`kubectl get events --field-selector reason=FreeDiskSpaceFailed`) "
        "against the SandboxPool's images cached per node.",
        evidence={
            "early_median_seconds": e,
            "late_median_seconds": l_,
            "slope_seconds_per_hour": slope,
            "span_hours": span / 3600,
            "early_stage_medians": early_stages,
            "late_stage_medians": late_stages,
            "trials": len(points),
        },
        steps=sorted({t.step for t in late}),
        trials=[t.trial for t in sorted(late, key=lambda t: -(t.start_seconds or 0.0))],
    )


@rule("tamper-findings", "Tamper findings in trials")
def tamper_findings(facts: RunFacts) -> Finding | None:
    """A step where ≥ 2 and ≥ 5% of the trials carry tamper findings (tests or test hooks touched,
    symlinks, network attempts, tampered results): the policy may be learning to game the reward.
    A warning; the kinds and whether the share rises are in the evidence."""
    rows = []
    tampered: list[TrialFacts] = []
    for step, trials in _agent_steps(facts):
        hit = [t for t in trials if t.tamper_kinds]
        if len(hit) >= TAMPER_MIN and len(hit) >= TAMPER_SHARE * len(trials):
            rows.append(
                {"step": step, "trials": len(trials), "tampered": len(hit), "share": len(hit) / len(trials)}
            )
            tampered += hit
    if not rows:
        return None
    kinds = Counter(k for t in tampered for k in t.tamper_kinds)
    shares = [float(r["share"]) for r in rows]
    rising = len(shares) >= 2 and shares[-1] > shares[0]
    gaming = sum(kinds[k] for k in kinds if k != "test_file_modified")
    return finding(
        tamper_findings,
        "warning",
        f"{len(tampered)} trials in {steps_phrase(int(r['step']) for r in rows)} carry tamper findings "
        f"({', '.join(f'{k} ×{v}' for k, v in kinds.most_common(3))})"
        + ("; the share is rising" if rising else "")
        + ".",
        ranked(
            [
                (
                    2.0 if rising or gaming else 1.0,
                    "the policy is learning to game verification (editing tests, adding conftest or "
                    "pytest hooks, reaching for the network)",
                ),
                (
                    1.5 if not gaming else 0.5,
                    "the tasks' real fixes touch test files (a false positive, e.g. issues that live in "
                    "the tests)",
                ),
            ]
        ),
        "Read the example trials' diffs and findings in the UI; with tamperPolicy StripAndReport the "
        "tampered parts were stripped before verification — use FailTrial if the policy keeps at it.",
        evidence={"per_step": rows, "kinds": dict(kinds), "rising": rising},
        steps=[int(r["step"]) for r in rows],
        trials=[t.trial for t in tampered],
    )


_INFRA_CAUSES: Final = {
    R.SANDBOX_ERROR: (
        "sandboxes fail to start or die (evicted pods, out of memory, setup failures, image pulls)"
    ),
    R.ENGINE_ERROR: "the rollout engine is down, overloaded, or unavailable past the proxy's retry budget",
    R.PROXY_ERROR: "the trial proxies fail (a journal write on a full disk, a crash)",
    R.VERIFIER_ERROR: "verification cannot run (see the verifier finding)",
    R.DEFENSE_FAILED: "defense self-tests fail (see the defense finding)",
    R.CANCELLED: "the run was stopped, suspended or restarted while trials ran",
}


@rule("infra-failures", "Many infrastructure failures")
def infra_failures(facts: RunFacts) -> Finding | None:
    """A step where ≥ 25% of the trials ended for infrastructure reasons (sandbox, engine, proxy,
    verifier, defense, cancelled). Critical above stop.maxInfraFailurePercent, where the run
    controller fails the run. The dominant reasons order the causes."""
    limit = facts.spec.max_infra_failure_percent / 100
    rows: list[dict[str, Any]] = []
    failed: list[TrialFacts] = []
    for step, trials in _agent_steps(facts):
        infra = [t for t in trials if t.infra]
        if len(trials) < MIN_TRIALS or len(infra) < INFRA_WARNING_SHARE * len(trials):
            continue
        rows.append(
            {
                "step": step,
                "trials": len(trials),
                "infra": len(infra),
                "by_reason": dict(Counter(t.termination_reason for t in infra)),
            }
        )
        failed += infra
    if not rows:
        return None
    critical = any(r["infra"] > limit * r["trials"] for r in rows)
    reasons = Counter(t.termination_reason for t in failed)
    causes = [_INFRA_CAUSES[R(r)] for r, _ in reasons.most_common() if R(r) in INFRA_REASONS]
    total = sum(int(r["trials"]) for r in rows)
    return finding(
        infra_failures,
        "critical" if critical else "warning",
        f"{len(failed)} of {total} trials ({pct(len(failed), total)}) in "
        f"{steps_phrase(int(r['step']) for r in rows)} ended for infrastructure reasons "
        f"({', '.join(f'{k} {v}' for k, v in reasons.most_common())}); the run fails above "
        f"{facts.spec.max_infra_failure_percent}% in a step.",
        causes,
        "Read the errors of the example trials (grouped in the evidence) and follow the finding of the "
        "dominant reason.",
        evidence={
            "per_step": rows,
            "errors": common_errors(failed),
            "limit_percent": facts.spec.max_infra_failure_percent,
        },
        steps=[int(r["step"]) for r in rows],
        trials=[t.trial for t in failed],
    )
