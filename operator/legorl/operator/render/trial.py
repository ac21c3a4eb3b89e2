"""A trial's objects: the task ConfigMap and trial pod, then the change set, full task and verify pod.

The pod templates are the pool's (`render.pool.trial_pod`, `verify_pod`); this module makes them one
run's children (owner reference and owner label, run/trial/step/split labels, the request as an
annotation for adoption after an operator restart) and adds what the Kubernetes backend's collection
needs: a `hold` container that keeps the trial pod and its proxy alive after the agent exits, and a
backstop deadline long enough for the operator to collect and verify. The agent's copy of the task
carries no gold fix and no hidden-test contents. Pure functions, unit-tested with kubernetes-validate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from legorl.api.annotations import AgentOutcomeNote
from legorl.api.kinds import RLRun, SandboxPool
from legorl.api.labels import (
    AGENT_OUTCOME_ANNOTATION,
    COMPONENT_LABEL,
    OWNER_LABEL,
    REQUEST_ANNOTATION,
    RUN_LABEL,
    SPLIT_LABEL,
    STEP_LABEL,
    TRIAL_LABEL,
    WARM_LABEL,
)
from legorl.api.timestamps import format_time
from legorl.controller.backend import TrialRequest
from legorl.operator.render.common import (
    MANAGED_BY,
    RenderContext,
    label_value,
    owner_key,
    owner_reference,
    restricted_container,
)
from legorl.operator.render.pool import AGENT_UID, TrialContext, trial_pod, verify_pod
from legorl.sandbox.task import Task, patch_files

HOLD = "hold"
COLLECT_GRACE_SECONDS = 300
"""Added to the trial pod's backstop deadline: time for the operator to collect and verify."""
CLAIMED_AT_ANNOTATION = "legorl.dev/claimed-at"
"""On a claimed warm trial pod: when its trial was launched (a restarted operator's agent clock)."""
WARM_WAIT_SECONDS = 6 * 3600
"""How long a warm trial pod may wait for its claim (added to its backstop deadline, which the claim
lowers again: a pod's `activeDeadlineSeconds` may only go down)."""
MAX_LOOKAHEAD_IMAGES = 512
"""Images named in a pool's lookahead annotation at most (annotations share a 256 KiB budget)."""


def redacted_test_patch(test_patch: str) -> str:
    """The test patch reduced to its file headers: setup learns which files to remove (the hidden tests)
    without their contents, which the agent's pod would otherwise carry in its task ConfigMap."""
    lines = []
    for item in patch_files(test_patch):
        lines.append(f"diff --git a/{item.path} b/{item.path}")
        if item.created:
            lines += ["new file mode 100644", "--- /dev/null"]
        else:
            lines.append(f"--- a/{item.path}")
        lines.append(f"+++ b/{item.path}")
    return "\n".join(lines) + "\n"


AGENT_TASK_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "version",
    "image",
    "workspace_dir",
    "test_command",
    "test_timeout_seconds",
)
"""Task fields the trial pod may see as they are; everything else (the gold fix, extra columns of
a dataset that may carry answers) stays out of its ConfigMap."""


def agent_task_row(task: Task) -> dict[str, Any]:
    """The task as the trial pod sees it (setup reads it, the agent can): a whitelist of fields, the
    hidden tests named but not shown, no test ids (they name the hidden tests). Verify gets the full row."""
    full = task.to_dict()
    row = {key: full[key] for key in AGENT_TASK_FIELDS if key in full}
    row.update(
        {
            "patch": "",
            "test_patch": redacted_test_patch(task.test_patch),
            "FAIL_TO_PASS": ["hidden"],
            "PASS_TO_PASS": [],
        }
    )
    return row


def pod_name(run: str, trial: str) -> str:
    return f"{run}-{trial}"


@dataclass(frozen=True)
class TrialNames:
    """Names of one trial's objects."""

    pod: str
    task: str
    verify: str
    verify_task: str
    changes: str

    @classmethod
    def of(cls, run: str, trial: str) -> TrialNames:
        base = pod_name(run, trial)
        return cls(base, f"{base}-task", f"{base}-verify", f"{base}-verify-task", f"{base}-changes")


@dataclass(frozen=True)
class FleetAccess:
    """What a trial's proxy needs to know of the fleet."""

    url: str
    served_model_name: str = "policy"
    capture_routed_experts: bool = False


def _stamp(obj: dict[str, Any], run: RLRun, request: TrialRequest) -> dict[str, Any]:
    """Make `obj` a child of the run: owner reference, owner label, trial labels."""
    meta = obj["metadata"]
    meta["ownerReferences"] = [owner_reference(run)]
    meta.setdefault("labels", {}).update(
        {
            "app.kubernetes.io/managed-by": MANAGED_BY,
            OWNER_LABEL: owner_key("RLRun", run.metadata.name),
            RUN_LABEL: label_value(run.metadata.name),
            TRIAL_LABEL: label_value(request.trial),
            STEP_LABEL: str(request.step),
            SPLIT_LABEL: request.split,
        }
    )
    return obj


def _config_map(
    run: RLRun, request: TrialRequest, name: str, component: str, data: dict[str, str]
) -> dict[str, Any]:
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": run.metadata.namespace or "default",
            "labels": {COMPONENT_LABEL: component},
        },
        "data": data,
    }
    return _stamp(body, run, request)


def trial_context(
    run: RLRun, request: TrialRequest, fleet: FleetAccess, *, warm: bool = False
) -> TrialContext:
    assert request.task.image is not None
    sampling = run.spec.algorithm.sampling
    return TrialContext(
        run_name=run.metadata.name,
        trial_id=request.trial,
        task_image=request.task.image,
        harness=run.spec.harness,
        fleet_url=fleet.url,
        served_model_name=fleet.served_model_name,
        max_tokens_per_turn=sampling.max_tokens_per_turn,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        capture_routed_experts=fleet.capture_routed_experts,
        task_config_map=TrialNames.of(run.metadata.name, request.trial).task,
        warm=warm,
    )


def backstop_seconds(pool: SandboxPool) -> int:
    """A trial pod's `activeDeadlineSeconds` from the moment its trial starts."""
    deadlines = pool.spec.deadlines
    return (
        deadlines.setup_seconds + deadlines.agent_seconds + deadlines.verify_seconds + COLLECT_GRACE_SECONDS
    )


def trial_objects(
    run: RLRun,
    pool: SandboxPool,
    request: TrialRequest,
    fleet: FleetAccess,
    ctx: RenderContext,
    *,
    warm: bool = False,
) -> list[dict[str, Any]]:
    """What `launch` applies: the task ConfigMap and the trial pod (pure). WARM: a pod made ready ahead,
    its agent waiting at the gate until `claim_patch` and the proxy's `POST /claim`."""
    names = TrialNames.of(run.metadata.name, request.trial)
    task = request.task
    config_map = _config_map(
        run,
        request,
        names.task,
        "trial-task",
        {
            "task.json": json.dumps(agent_task_row(task), sort_keys=True),
            "problem.md": task.problem_statement,
        },
    )
    pod = trial_pod(pool, trial_context(run, request, fleet, warm=warm), ctx)
    _stamp(pod, run, request)
    pod["metadata"].setdefault("annotations", {})[REQUEST_ANNOTATION] = request.note().to_json()
    if warm:
        pod["metadata"]["labels"][WARM_LABEL] = "waiting"
    spec = pod["spec"]
    # A backstop for an operator that is gone: the operator ends the agent stage at setup + agent
    # seconds itself, and needs the proxy alive for collection and until verify is done.
    spec["activeDeadlineSeconds"] = backstop_seconds(pool) + (WARM_WAIT_SECONDS if warm else 0)
    spec["containers"].append(
        {
            # Keeps the pod (and the proxy sidecar with the trial's journal) running after the agent
            # exits, until the operator has read the results and deletes the pod.
            "name": HOLD,
            "image": pool.spec.pre_pull.pause_image,
            "imagePullPolicy": "IfNotPresent",
            "resources": {"requests": {"cpu": "1m", "memory": "8Mi"}, "limits": {"memory": "32Mi"}},
            "securityContext": restricted_container(user=AGENT_UID),
        }
    )
    return [config_map, pod]


def claim_patch(
    pool: SandboxPool, request: TrialRequest, waited_seconds: float, claimed_at: datetime
) -> dict[str, Any]:
    """The merge patch that marks a warm trial pod claimed by REQUEST (its request as launched: the policy
    version of now) at CLAIMED_AT, and brings its backstop deadline back to a cold pod's, counted from
    the claim (the pod started WAITED_SECONDS before it)."""
    return {
        "metadata": {
            "labels": {WARM_LABEL: "claimed"},
            "annotations": {
                REQUEST_ANNOTATION: request.note().to_json(),
                CLAIMED_AT_ANNOTATION: format_time(claimed_at),
            },
        },
        "spec": {"activeDeadlineSeconds": int(waited_seconds) + 1 + backstop_seconds(pool)},
    }


def verify_objects(
    run: RLRun,
    pool: SandboxPool,
    request: TrialRequest,
    fleet: FleetAccess,
    ctx: RenderContext,
    *,
    changes: Mapping[str, Any],
    agent_outcome: AgentOutcomeNote,
) -> list[dict[str, Any]]:
    """The full task, the change set and the verify pod (pure). `agent_outcome` says how the
    agent stage ended; it rides on the verify pod so a restarted operator still knows."""
    names = TrialNames.of(run.metadata.name, request.trial)
    task_cm = _config_map(
        run,
        request,
        names.verify_task,
        "verify-task",
        {"task.json": json.dumps(request.task.to_dict(), sort_keys=True)},
    )
    changes_cm = _config_map(
        run, request, names.changes, "changes", {"changes.json": json.dumps(changes, sort_keys=True)}
    )
    context = trial_context(run, request, fleet)
    context = TrialContext(**{**context.__dict__, "task_config_map": names.verify_task})
    pod = verify_pod(pool, context, ctx, changes_config_map=names.changes)
    _stamp(pod, run, request)
    pod["metadata"].setdefault("annotations", {}).update(
        {
            REQUEST_ANNOTATION: request.note().to_json(),
            AGENT_OUTCOME_ANNOTATION: agent_outcome.to_json(),
        }
    )
    return [task_cm, changes_cm, pod]


def lookahead_value(policy: str, current: Sequence[str], upcoming: Sequence[str]) -> list[str] | None:
    """The pool's new lookahead annotation (None: leave it): `Lookahead` names the upcoming images in
    order; `All` keeps every image ever named (the pool caches all of them)."""
    if policy == "Never":
        return None
    fresh = list(dict.fromkeys(upcoming))
    wanted = fresh if policy == "Lookahead" else list(dict.fromkeys([*current, *fresh]))
    wanted = wanted[:MAX_LOOKAHEAD_IMAGES]
    return None if wanted == list(current) else wanted
