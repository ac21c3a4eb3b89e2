"""The Argo CD health checks (docs/argocd/*.lua), run for real in Lua 5.1 (Argo CD's gopher-lua speaks
5.1) against statuses built from the API models: every RLRun phase and every documented fleet and pool
reason maps to the state a GitOps user should see, and docs/argocd/argocd-cm.yaml carries the same
scripts. `LEGORL_UPDATE_GOLDEN=1` rewrites argocd-cm.yaml from the scripts.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lupa.lua51 as lua  # type: ignore[import-untyped]
import pytest
import yaml

from legorl.api.common import Condition
from legorl.api.conditions import FleetReason, PoolReason, RunPhase, rlrun_phase, set_condition
from legorl.api.fleet import RolloutFleetStatus
from legorl.api.pool import SandboxPoolStatus
from legorl.api.run import RLRunStatus

ARGOCD = Path(__file__).resolve().parents[2] / "docs" / "argocd"
SCRIPTS = {"RLRun": "rlrun.lua", "RolloutFleet": "rolloutfleet.lua", "SandboxPool": "sandboxpool.lua"}
STATES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}
NOW = datetime(2026, 1, 1, tzinfo=UTC)
GENERATION = 3

Conds = list[tuple[str, str, str]]
"""(type, status, reason) of each condition."""


def conditions(spec: Conds) -> list[Condition]:
    out: list[Condition] = []
    for type_, status, reason in spec:
        out = set_condition(
            out,
            type_=type_,
            status=status,  # type: ignore[arg-type]
            reason=reason,
            message=f"{type_} says {reason}",
            generation=GENERATION,
            now=NOW,
        )
    return out


def health(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """What Argo CD would show for `obj`: the script run with `obj` as its global, as Argo CD does."""
    runtime = lua.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals().obj = runtime.table_from(obj, recursive=True)
    result = runtime.execute((ARGOCD / SCRIPTS[kind]).read_text(encoding="utf-8"))
    out = dict(result)
    assert out["status"] in STATES, out
    assert isinstance(out.get("message"), str) and out["message"], out
    return out


def resource(kind: str, status: dict[str, Any] | None, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x", "namespace": "ns", "generation": GENERATION},
        "spec": spec or {},
    }
    if status is not None:
        body["status"] = status
    return body


# --- RLRun ------------------------------------------------------------------------------------------

PHASE_HEALTH = {
    "Pending": "Progressing",
    "Running": "Progressing",
    "Succeeded": "Healthy",
    "Failed": "Degraded",
    "Invalid": "Degraded",
    "Degraded": "Degraded",
    "Suspended": "Suspended",
}
"""A run at work is Progressing until it ends, as Argo CD shows Jobs and Workflows."""

RUN_CASES: dict[str, tuple[Conds, bool]] = {
    "Pending": (
        [("Validated", "True", "Valid"), ("RolloutReady", "False", "FleetNotReady"),
         ("SandboxesReady", "True", "PoolReady"), ("Training", "False", "WaitingForDependencies")],
        False,
    ),
    "Running": (
        [("Validated", "True", "Valid"), ("RolloutReady", "True", "FleetReady"),
         ("SandboxesReady", "True", "PoolReady"), ("Training", "True", "Stepping"),
         ("Degraded", "False", "AsExpected")],
        False,
    ),
    "Succeeded": (
        [("Validated", "True", "Valid"), ("Training", "False", "Stopped"),
         ("Succeeded", "True", "MaxStepsReached")],
        False,
    ),
    "Failed": (
        [("Validated", "True", "Valid"), ("Training", "False", "Stopped"),
         ("Failed", "True", "TrainerFailed")],
        False,
    ),
    "Invalid": ([("Validated", "False", "InvalidSpec")], False),
    "Degraded": (
        [("Validated", "True", "Valid"), ("Training", "True", "Stepping"),
         ("Degraded", "True", "FidelityBelowThreshold")],
        False,
    ),
    "Suspended": (
        [("Validated", "True", "Valid"), ("Training", "False", "Suspended")],
        True,
    ),
}  # fmt: skip


def test_every_run_phase_has_a_health() -> None:
    assert set(PHASE_HEALTH) == {phase.value for phase in RunPhase} == set(RUN_CASES)


@pytest.mark.parametrize("phase", sorted(RUN_CASES))
@pytest.mark.parametrize("with_phase", [True, False], ids=["phase", "conditions-only"])
def test_run_health(phase: str, with_phase: bool) -> None:
    spec_conditions, suspend = RUN_CASES[phase]
    conds = conditions(spec_conditions)
    derived, reason = rlrun_phase(conds, suspend)
    assert derived.value == phase  # the fixture is what the operator would make of these conditions
    status = RLRunStatus(
        observed_generation=GENERATION,
        conditions=conds,
        phase=derived.value,  # type: ignore[arg-type]  # a RunPhase value, one of the Literal's
        reason=reason,
        step=7,
    ).to_wire()
    if not with_phase:
        status.pop("phase")  # the script derives the phase as the operator does
    result = health("RLRun", resource("RLRun", status, {"suspend": suspend, "stop": {"maxSteps": 10}}))
    assert result["status"] == PHASE_HEALTH[phase]
    assert result["message"].startswith(phase)
    if phase in ("Running", "Degraded", "Suspended"):
        assert "step 7 of 10" in result["message"]
    if phase == "Failed":
        assert "Failed says TrainerFailed" in result["message"]


# --- RolloutFleet -----------------------------------------------------------------------------------

FLEET_OK: Conds = [("Progressing", "False", "RolloutComplete"), ("Degraded", "False", "AsExpected")]
FLEET_CASES: dict[str, tuple[Conds, str]] = {
    "ready": ([("Ready", "True", "AllReplicasReady"), *FLEET_OK], "Healthy"),
    "weight sync between steps": (
        [("Ready", "True", "AllReplicasReady"), ("Progressing", "True", "WeightSyncInProgress"),
         ("Degraded", "False", "AsExpected")],
        "Healthy",
    ),
    "rolling out": (
        [("Ready", "True", "AllReplicasReady"), ("Progressing", "True", "RolloutInProgress"),
         ("Degraded", "False", "AsExpected")],
        "Progressing",
    ),
    "loading the model": ([("Ready", "False", "ModelLoading"), *FLEET_OK], "Progressing"),
    "replicas coming up": (
        [("Ready", "False", "ReplicasNotReady"), ("Progressing", "True", "RolloutInProgress"),
         ("Degraded", "False", "AsExpected")],
        "Progressing",
    ),
    "scaled to zero": ([("Ready", "False", "ScaledToZero"), *FLEET_OK], "Healthy"),
    "crash loop": (
        [("Ready", "False", "ReplicasNotReady"), ("Progressing", "False", "RolloutComplete"),
         ("Degraded", "True", "CrashLoop")],
        "Degraded",
    ),
    "image pull": (
        [("Ready", "False", "ReplicasNotReady"), ("Progressing", "True", "RolloutInProgress"),
         ("Degraded", "True", "ImagePullFailed")],
        "Degraded",
    ),
    "unschedulable": (
        [("Ready", "False", "ReplicasNotReady"), ("Progressing", "True", "RolloutInProgress"),
         ("Degraded", "True", "Unschedulable")],
        "Degraded",
    ),
    "rollout deadline": (
        [("Ready", "False", "ReplicasNotReady"), ("Progressing", "False", "ProgressDeadlineExceeded"),
         ("Degraded", "True", "ProgressDeadlineExceeded")],
        "Degraded",
    ),
    "rollout deadline, Progressing only": (
        [("Ready", "True", "AllReplicasReady"), ("Progressing", "False", "ProgressDeadlineExceeded")],
        "Degraded",
    ),
    "version skew": (
        [("Ready", "True", "AllReplicasReady"), ("Progressing", "True", "WeightSyncInProgress"),
         ("Degraded", "True", "PolicyVersionSkew")],
        "Degraded",
    ),
    "invalid spec": (
        [("Ready", "False", "InvalidSpec"), ("Progressing", "False", "InvalidSpec"),
         ("Degraded", "True", "InvalidSpec")],
        "Degraded",
    ),
    # What the operator writes for a stored object that does not parse: Ready alone.
    "unparseable": ([("Ready", "False", "InvalidSpec")], "Degraded"),
}  # fmt: skip


def test_fleet_cases_cover_every_reason() -> None:
    used = {reason for conds, _ in FLEET_CASES.values() for _, _, reason in conds}
    assert used == {reason.value for reason in FleetReason}


@pytest.mark.parametrize("case", sorted(FLEET_CASES))
def test_fleet_health(case: str) -> None:
    spec_conditions, expected = FLEET_CASES[case]
    status = RolloutFleetStatus(
        observed_generation=GENERATION, conditions=conditions(spec_conditions), replicas=2, ready_replicas=1
    ).to_wire()
    result = health("RolloutFleet", resource("RolloutFleet", status))
    assert result["status"] == expected, result
    if expected == "Degraded":
        assert " says " in result["message"]  # the operator's own message travels along


# --- SandboxPool ------------------------------------------------------------------------------------

POOL_OK: Conds = [
    ("ImagesCached", "True", "AllImagesCached"),
    ("DefensesVerified", "True", "SelfTestPassed"),
    ("Degraded", "False", "AsExpected"),
]
POOL_CASES: dict[str, tuple[Conds, str]] = {
    "ready": ([("Ready", "True", "PoolReady"), *POOL_OK], "Healthy"),
    "ready, pre-pull off": (
        [("Ready", "True", "PoolReady"), ("ImagesCached", "False", "PrePullDisabled"),
         ("DefensesVerified", "True", "SelfTestPassed"), ("Degraded", "False", "AsExpected")],
        "Healthy",
    ),
    "ready, images named later": (
        [("Ready", "True", "PoolReady"), ("ImagesCached", "False", "TaskSetImagesUnknown"),
         ("DefensesVerified", "True", "DefensesRelaxedBySpec"), ("Degraded", "False", "AsExpected")],
        "Healthy",
    ),
    "pulling": (
        [("Ready", "False", "WarmCapacityNotReady"), ("ImagesCached", "False", "PullInProgress"),
         ("DefensesVerified", "False", "SelfTestPending"), ("Degraded", "False", "AsExpected")],
        "Progressing",
    ),
    "pull failed": (
        [("Ready", "True", "PoolReady"), ("ImagesCached", "False", "PullFailed"),
         ("DefensesVerified", "True", "SelfTestPassed"), ("Degraded", "True", "PullFailed")],
        "Degraded",
    ),
    "no nodes": (
        [("Ready", "False", "NoMatchingNodes"), ("ImagesCached", "False", "NoMatchingNodes"),
         ("DefensesVerified", "False", "SelfTestPending"), ("Degraded", "True", "NoMatchingNodes")],
        "Degraded",
    ),
    "self-test failed": (
        [("Ready", "False", "SelfTestFailed"), ("ImagesCached", "True", "AllImagesCached"),
         ("DefensesVerified", "False", "SelfTestFailed"), ("Degraded", "True", "SelfTestFailed")],
        "Degraded",
    ),
    "self-test failed, Degraded not yet written": (
        [("Ready", "False", "SelfTestFailed"), ("DefensesVerified", "False", "SelfTestFailed")],
        "Degraded",
    ),
    "warm sandboxes failing": (
        [("Ready", "False", "WarmCapacityNotReady"), *POOL_OK[:2],
         ("Degraded", "True", "WarmCapacityNotReady")],
        "Degraded",
    ),
    "invalid spec": ([("Ready", "False", "InvalidSpec")], "Degraded"),
}  # fmt: skip


def test_pool_cases_cover_every_reason() -> None:
    used = {reason for conds, _ in POOL_CASES.values() for _, _, reason in conds}
    assert used == {reason.value for reason in PoolReason}


@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_pool_health(case: str) -> None:
    spec_conditions, expected = POOL_CASES[case]
    status = SandboxPoolStatus(
        observed_generation=GENERATION, conditions=conditions(spec_conditions)
    ).to_wire()
    result = health("SandboxPool", resource("SandboxPool", status))
    assert result["status"] == expected, result


# --- every kind -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_no_status_yet_is_progressing(kind: str) -> None:
    assert health(kind, resource(kind, None))["status"] == "Progressing"
    assert health(kind, resource(kind, {"observedGeneration": 0}))["status"] == "Progressing"


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_a_generation_not_yet_reconciled_is_progressing(kind: str) -> None:
    # Degraded at the last generation the operator saw; the spec changed since.
    stale = {
        "observedGeneration": GENERATION - 1,
        "conditions": [c.to_wire() for c in conditions([("Degraded", "True", "CrashLoop")])],
        "phase": "Degraded",
    }
    result = health(kind, resource(kind, stale))
    assert result["status"] == "Progressing"
    assert f"generation {GENERATION}" in result["message"]


def argocd_cm() -> str:
    """docs/argocd/argocd-cm.yaml as the scripts make it."""
    out = [
        "# Argo CD health checks for legorl's kinds: merge into the argocd-cm ConfigMap, e.g.",
        "#",
        "#   kubectl -n argocd patch configmap argocd-cm --patch-file docs/argocd/argocd-cm.yaml",
        "#",
        "# (or put the same keys under `configs.cm` of the argo-cd Helm chart). The scripts are the files",
        "# docs/argocd/*.lua; tests/operator/test_argocd_health.py runs them and keeps this file equal to",
        "# them (LEGORL_UPDATE_GOLDEN=1 pytest tests/operator/test_argocd_health.py rewrites it).",
        "data:",
    ]
    for kind, name in SCRIPTS.items():
        out.append(f"  resource.customizations.health.legorl.dev_{kind}: |")
        out += [f"    {line}".rstrip() for line in (ARGOCD / name).read_text(encoding="utf-8").splitlines()]
    return "\n".join(out) + "\n"


def test_argocd_cm_snippet_carries_the_scripts() -> None:
    path = ARGOCD / "argocd-cm.yaml"
    if os.environ.get("LEGORL_UPDATE_GOLDEN"):
        path.write_text(argocd_cm(), encoding="utf-8")
    assert path.read_text(encoding="utf-8") == argocd_cm(), "run LEGORL_UPDATE_GOLDEN=1 pytest " + __file__
    data = yaml.safe_load(path.read_text(encoding="utf-8"))["data"]
    for kind, name in SCRIPTS.items():
        assert data[f"resource.customizations.health.legorl.dev_{kind}"] == (ARGOCD / name).read_text()
