"""RolloutFleet status from what is observed: replicas, endpoints, served version, conditions."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from legorl.api.conditions import FleetConditionType as T
from legorl.api.conditions import FleetReason as R
from legorl.api.conditions import rfc3339
from legorl.api.fleet import FleetEndpoint, RolloutFleetStatus
from legorl.api.kinds import RolloutFleet
from legorl.api.labels import REPLICA_LABEL
from legorl.api.timestamps import parse_time
from legorl.operator.observe import Observed, PodView
from legorl.operator.render.common import selector_string
from legorl.operator.render.fleet import LWS_WORKER_INDEX, STS_POD_INDEX, engine_name, engine_selector
from legorl.operator.status.common import ConditionSet, listing, pod_problem

INITIAL_POLICY_VERSION = "0"
"""What a replica serves before any weight sync annotates it: the checkpoint in spec.model."""


def _groups(fleet: RolloutFleet, pods: list[PodView]) -> dict[str, list[PodView]]:
    """Pods by replica: one pod each for Deployments, a leader + workers group otherwise."""
    out: dict[str, list[PodView]] = defaultdict(list)
    for pod in pods:
        if fleet.spec.parallelism.nodes_per_replica == 1:
            key = pod.name
        else:
            key = pod.labels.get(REPLICA_LABEL) or pod.labels.get(
                "leaderworkerset.sigs.k8s.io/group-index", pod.name
            )
        out[key].append(pod)
    return out


def _leader(fleet: RolloutFleet, group: list[PodView]) -> PodView | None:
    if fleet.spec.parallelism.nodes_per_replica == 1:
        return group[0]
    # LeaderWorkerSet leaders are ordinal <group> of the leader StatefulSet (their pod-index is the
    # group index), so its worker index decides; StatefulSet groups (no LWS labels) use the ordinal.
    return next(
        (p for p in group if p.labels.get(LWS_WORKER_INDEX, p.labels.get(STS_POD_INDEX)) == "0"), None
    )


def serving_leaders(fleet: RolloutFleet, pods: list[PodView]) -> list[PodView]:
    """Each replica's leader that is ready and has an address (the pods that answer `GET /weight_info`),
    by name."""
    groups = _groups(fleet, [p for p in pods if not p.deleting])
    leaders = (_leader(fleet, group) for group in groups.values())
    return sorted((p for p in leaders if p is not None and p.ready and p.ip), key=lambda p: p.name)


@dataclass
class _Replicas:
    """What the pods say about the fleet's replicas."""

    groups: dict[str, list[PodView]]
    ready: int
    endpoints: list[FleetEndpoint]
    versions: set[str]


def _replicas(fleet: RolloutFleet, pods: list[PodView]) -> _Replicas:
    size = fleet.spec.parallelism.nodes_per_replica
    groups = _groups(fleet, pods)
    endpoints: list[FleetEndpoint] = []
    ready_groups = 0
    versions: set[str] = set()
    for key in sorted(groups):
        group = groups[key]
        leader = _leader(fleet, group)
        ready = leader is not None and sum(p.ready for p in group) >= size
        if leader is not None and leader.ip:
            version = leader.policy_version or INITIAL_POLICY_VERSION
            endpoints.append(
                FleetEndpoint(
                    name=leader.name,
                    url=f"http://{leader.ip}:{fleet.spec.port}/v1",
                    ready=ready,
                    policy_version=version,
                )
            )
            if ready:
                versions.add(version)
        ready_groups += ready
    desired = fleet.spec.replicas
    return _Replicas(groups, min(ready_groups, desired) if desired else ready_groups, endpoints, versions)


def _rollout(fleet: RolloutFleet, observed: Observed, groups: int) -> tuple[list[str], str | None]:
    """(what is still rolling out, the progress-deadline message if the rollout gave up)."""
    desired = fleet.spec.replicas
    if fleet.spec.parallelism.nodes_per_replica > 1:
        return ([f"{groups}/{desired} replica groups exist"] if groups < desired else []), None
    deploy = observed.child("Deployment", engine_name(fleet.metadata.name))
    if deploy is None:
        return ["the engine Deployment is being created"], None
    rolling: list[str] = []
    counters = deploy.counters
    if deploy.observed_generation < deploy.generation:
        rolling.append("the Deployment controller has not seen the latest template yet")
    elif counters.get("updatedReplicas", 0) < desired:
        rolling.append(f"{counters.get('updatedReplicas', 0)}/{desired} replicas run the current template")
    elif counters.get("replicas", 0) > desired:
        rolling.append(f"{counters.get('replicas', 0) - desired} old replicas are shutting down")
    status, reason, message = deploy.conditions.get("Progressing", ("", "", ""))
    if status == "False" and reason == "ProgressDeadlineExceeded":
        return rolling, message or f"the rollout did not finish within {fleet.spec.startup_seconds}s"
    return rolling, None


def _set_ready(
    conds: ConditionSet, fleet: RolloutFleet, reps: _Replicas, pods: list[PodView], rolling: list[str]
) -> None:
    desired, size = fleet.spec.replicas, fleet.spec.parallelism.nodes_per_replica
    served = next(iter(reps.versions)) if len(reps.versions) == 1 else None
    problems = [pp for p in pods if (pp := pod_problem(p)) is not None]
    if desired == 0:
        conds.set(T.READY, "False", R.SCALED_TO_ZERO, "spec.replicas is 0; scale up to serve the policy")
        return
    if reps.ready >= desired:
        version = f" policy version {served}" if served else ""
        conds.set(T.READY, "True", R.ALL_REPLICAS_READY, f"{reps.ready}/{desired} replicas serve{version}")
        return
    waiting = [name for name, group in sorted(reps.groups.items()) if sum(p.ready for p in group) < size]
    running = [p for p in pods if p.phase == "Running" and not p.ready]
    if problems:
        conds.set(
            T.READY, "False", R.REPLICAS_NOT_READY, f"{reps.ready}/{desired} replicas ready; {problems[0][1]}"
        )
    elif running and not rolling:
        conds.set(
            T.READY,
            "False",
            R.MODEL_LOADING,
            f"{reps.ready}/{desired} replicas ready; {listing(p.name for p in running)} running and loading "
            f"the model (startupSeconds allows {fleet.spec.startup_seconds}s)",
        )
    else:
        detail = f"; waiting for {listing(waiting)}" if waiting else "; pods are being created"
        conds.set(T.READY, "False", R.REPLICAS_NOT_READY, f"{reps.ready}/{desired} replicas ready{detail}")


def _set_degraded(
    conds: ConditionSet,
    *,
    fleet: RolloutFleet,
    reps: _Replicas,
    pods: list[PodView],
    deadline: str | None,
    skew_since: str | None,
    now: datetime,
) -> None:
    problems = [pp for p in pods if (pp := pod_problem(p)) is not None]
    skew_too_long = False
    if len(reps.versions) > 1 and skew_since is not None:
        since = parse_time(skew_since)
        skew_too_long = (
            since is not None and (now - since).total_seconds() > fleet.spec.weight_sync.timeout_seconds
        )
    kinds = {kind for kind, _ in problems}
    if "pull" in kinds:
        conds.set(T.DEGRADED, "True", R.IMAGE_PULL_FAILED, _first(problems, "pull"))
    elif "crash" in kinds:
        conds.set(T.DEGRADED, "True", R.CRASH_LOOP, _first(problems, "crash"))
    elif "unschedulable" in kinds:
        conds.set(T.DEGRADED, "True", R.UNSCHEDULABLE, _first(problems, "unschedulable"))
    elif deadline is not None:
        conds.set(T.DEGRADED, "True", R.PROGRESS_DEADLINE_EXCEEDED, deadline)
    elif skew_too_long:
        conds.set(
            T.DEGRADED,
            "True",
            R.POLICY_VERSION_SKEW,
            f"ready replicas serve {listing(sorted(reps.versions))} for longer than "
            f"weightSync.timeoutSeconds ({fleet.spec.weight_sync.timeout_seconds}s); "
            "restart the lagging replicas",
        )
    else:
        conds.set(T.DEGRADED, "False", R.AS_EXPECTED, "")


def compute_fleet_status(
    fleet: RolloutFleet,
    observed: Observed,
    now: datetime,
    render_error: str | None = None,
) -> RolloutFleetStatus:
    """The whole status of a fleet; `render_error` is why its children could not be rendered."""
    previous = fleet.status or RolloutFleetStatus()
    generation = fleet.metadata.generation or 0
    conds = ConditionSet(previous.conditions, generation, now)
    selector = selector_string(engine_selector(fleet))
    if render_error is not None:
        for type_ in (T.READY, T.PROGRESSING):
            conds.set(type_, "False", R.INVALID_SPEC, render_error)
        conds.set(T.DEGRADED, "True", R.INVALID_SPEC, render_error)
        return previous.model_copy(
            update={"observed_generation": generation, "conditions": conds.conditions, "selector": selector}
        )
    pods = [p for p in observed.pods if not p.deleting]
    reps = _replicas(fleet, pods)
    rolling, deadline = _rollout(fleet, observed, len(reps.groups))
    if deadline is not None:
        conds.set(T.PROGRESSING, "False", R.PROGRESS_DEADLINE_EXCEEDED, deadline)
    elif rolling:
        conds.set(T.PROGRESSING, "True", R.ROLLOUT_IN_PROGRESS, "; ".join(rolling))
    elif len(reps.versions) > 1:
        conds.set(
            T.PROGRESSING,
            "True",
            R.WEIGHT_SYNC_IN_PROGRESS,
            f"ready replicas serve policy versions {listing(sorted(reps.versions))}",
        )
    else:
        conds.set(
            T.PROGRESSING,
            "False",
            R.ROLLOUT_COMPLETE,
            f"{fleet.spec.replicas} replica(s) run the current spec",
        )
    _set_ready(conds, fleet, reps, pods, rolling)
    # Skew is timed from when it began, not from Progressing's transition (which a rollout may own).
    skew_since = (previous.version_skew_since or rfc3339(now)) if len(reps.versions) > 1 else None
    _set_degraded(conds, fleet=fleet, reps=reps, pods=pods, deadline=deadline, skew_since=skew_since, now=now)
    return RolloutFleetStatus(
        observed_generation=generation,
        conditions=conds.conditions,
        replicas=len(reps.groups),
        ready_replicas=reps.ready,
        selector=selector,
        served_policy_version=next(iter(reps.versions)) if len(reps.versions) == 1 else None,
        endpoints=reps.endpoints[:1024],
        weights_owner=previous.weights_owner,
        version_skew_since=skew_since,
    )


def _first(problems: list[tuple[str, str]], kind: str) -> str:
    matching = [text for k, text in problems if k == kind]
    more = f" (and {len(matching) - 1} more pods)" if len(matching) > 1 else ""
    return matching[0] + more
