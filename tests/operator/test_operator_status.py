"""Status computation of the three kinds from kubelet- and controller-shaped object bodies."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest

from legorl.api.common import Condition
from legorl.api.conditions import find_condition
from legorl.api.fleet import RolloutFleetStatus
from legorl.api.kinds import RLRun, RolloutFleet, SandboxPool
from legorl.api.labels import HASH_ANNOTATION, POLICY_VERSION_ANNOTATION
from legorl.api.pool import SandboxPoolStatus
from legorl.api.run import RLRunStatus
from legorl.manifests.problems import Problem
from legorl.operator.observe import Observed, child_view, pod_view
from legorl.operator.render.common import labels
from legorl.operator.render.fleet import APP as ENGINE_APP
from legorl.operator.render.fleet import COMPONENT as ENGINE
from legorl.operator.render.pool import APP as SANDBOX_APP
from legorl.operator.render.pool import PREPULL, WARM, desired_images
from legorl.operator.status.fleet import compute_fleet_status
from legorl.operator.status.pool import MAX_FAILURE_MESSAGE, compute_pool_status
from legorl.operator.status.run import compute_run_status

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
STAMP = "2026-11-30T12:00:00Z"
NS = "rl-research"
ENGINE_IMAGE = "vllm/vllm-openai:v0.33.0"
DJANGO = "ghcr.io/example/swe-tasks/django-11099:v1"
SYMPY = "ghcr.io/example/swe-tasks/sympy-20590:v1"
PAUSE = "registry.k8s.io/pause:3.10"

ResourceT = TypeVar("ResourceT", RolloutFleet, SandboxPool, RLRun)

# --- builders: our custom resources --------------------------------------------------------


def make_fleet(
    *, name: str = "coder-fleet", generation: int = 2, status: dict[str, Any] | None = None, **spec: Any
) -> RolloutFleet:
    body: dict[str, Any] = {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": name, "namespace": NS, "uid": "5e1f0c3a-fleet", "generation": generation},
        "spec": {"model": {"uri": "hf://Qwen/Qwen3-30B-A3B"}, "replicas": 2, **spec},
    }
    if status is not None:
        body["status"] = status
    return RolloutFleet.model_validate(body)


def make_pool(
    *, name: str = "python-repos", generation: int = 1, status: dict[str, Any] | None = None, **spec: Any
) -> SandboxPool:
    body: dict[str, Any] = {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": "SandboxPool",
        "metadata": {"name": name, "namespace": NS, "uid": "8a2b77d0-pool", "generation": generation},
        "spec": {"source": {"images": [DJANGO, SYMPY]}, **spec},
    }
    if status is not None:
        body["status"] = status
    return SandboxPool.model_validate(body)


def make_run(*, generation: int = 1, status: dict[str, Any] | None = None, **spec: Any) -> RLRun:
    body: dict[str, Any] = {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "coder-grpo", "namespace": NS, "uid": "c0ffee00-run", "generation": generation},
        "spec": {
            "mode": "Train",
            "policy": {"checkpoint": {"uri": "pvc://models/qwen3-coder-30b-a3b"}},
            "fleetRef": {"name": "coder-fleet"},
            "poolRef": {"name": "python-repos"},
            "harness": {"kind": "OpenCode", "version": "1.0.150"},
            "tasks": {"source": {"uri": "pvc://datasets/python-repos/tasks.jsonl"}},
            "store": {"uri": "pvc://rl-store/coder-grpo"},
            "stop": {"maxSteps": 200},
            **spec,
        },
    }
    if status is not None:
        body["status"] = status
    return RLRun.model_validate(body)


def fed_back(obj: ResourceT, status: RolloutFleetStatus | SandboxPoolStatus | RLRunStatus) -> ResourceT:
    """`obj` as the API server returns it after the operator patched `status` (a wire round trip)."""
    return type(obj).model_validate({**obj.to_wire(), "status": status.to_wire()})


# --- builders: pods as the kubelet reports them --------------------------------------------


def ts(at: datetime = NOW) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def running(name: str, image: str, *, ready: bool = True, restarts: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "imageID": f"{image.rpartition(':')[0]}@sha256:{'3f' * 32}",
        "containerID": f"containerd://{'9a' * 32}",
        "ready": ready,
        "started": True,
        "restartCount": restarts,
        "state": {"running": {"startedAt": ts(NOW - timedelta(minutes=4))}},
        "lastState": {},
    }


def waiting(
    name: str,
    image: str,
    reason: str,
    message: str = "",
    *,
    restarts: int = 0,
    last_terminated: dict[str, Any] | None = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {"reason": reason}
    if message:
        state["message"] = message
    return {
        "name": name,
        "image": image,
        "imageID": "",
        "ready": False,
        "started": False,
        "restartCount": restarts,
        "state": {"waiting": state},
        "lastState": {"terminated": last_terminated} if last_terminated else {},
    }


def terminated(name: str, image: str, *, exit_code: int = 0, reason: str = "Completed") -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "imageID": f"{image.rpartition(':')[0]}@sha256:{'5c' * 32}",
        "containerID": f"containerd://{'1b' * 32}",
        "ready": False,
        "started": False,
        "restartCount": 0,
        "state": {
            "terminated": {
                "exitCode": exit_code,
                "reason": reason,
                "startedAt": ts(NOW - timedelta(minutes=3)),
                "finishedAt": ts(NOW - timedelta(minutes=3)),
                "containerID": f"containerd://{'1b' * 32}",
            }
        },
        "lastState": {},
    }


def pod_conditions(
    *, ready: bool, initialized: bool = True, unready: str = "", unschedulable: str = ""
) -> list[dict[str, Any]]:
    """Pod conditions in the order the kubelet writes them."""
    at = ts(NOW - timedelta(minutes=5))
    if unschedulable:
        return [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
                "lastProbeTime": None,
                "lastTransitionTime": at,
            }
        ]

    def cond(type_: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {"type": type_, "status": "True" if ok else "False"}
        if not ok:
            out |= {"reason": reason, "message": message}
        return out | {"lastProbeTime": None, "lastTransitionTime": at}

    return [
        cond("PodReadyToStartContainers", True),
        cond("Initialized", initialized, "ContainersNotInitialized", "containers with incomplete status"),
        cond("Ready", ready, "ContainersNotReady", f"containers with unready status: [{unready}]"),
        cond("ContainersReady", ready, "ContainersNotReady", f"containers with unready status: [{unready}]"),
        cond("PodScheduled", True),
    ]


def pod(
    name: str,
    pod_labels: dict[str, str],
    *,
    containers: list[dict[str, Any]],
    init_containers: list[dict[str, Any]] | None = None,
    node: str = "gpu-node-1",
    ip: str = "10.42.1.17",
    phase: str = "Running",
    conditions: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    ready = all(c["ready"] for c in containers)
    unready = " ".join(c["name"] for c in containers if not c["ready"])
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": f"uid-{name}",
        "labels": pod_labels,
        "creationTimestamp": ts(NOW - timedelta(minutes=5)),
    }
    if annotations:
        meta["annotations"] = annotations
    if deleting:
        meta["deletionTimestamp"] = ts(NOW)
        meta["deletionGracePeriodSeconds"] = 60
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions if conditions is not None else pod_conditions(ready=ready, unready=unready),
        "qosClass": "Burstable",
    }
    spec: dict[str, Any] = {"containers": [{"name": c["name"], "image": c["image"]} for c in containers]}
    if conditions is None or any(c["type"] == "Initialized" for c in conditions):
        # Scheduled: the kubelet owns the pod and reports IPs and container states.
        spec["nodeName"] = node
        status |= {
            "hostIP": "10.0.3.11",
            "hostIPs": [{"ip": "10.0.3.11"}],
            "startTime": ts(NOW - timedelta(minutes=5)),
            "containerStatuses": containers,
        }
        if ip:
            status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
        if init_containers is not None:
            status["initContainerStatuses"] = init_containers
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def engine_pod(
    fleet: RolloutFleet,
    suffix: str,
    *,
    vllm: dict[str, Any] | None = None,
    ip: str = "10.42.1.17",
    node: str = "gpu-node-1",
    version: str | None = None,
    extra_labels: dict[str, str] | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """An engine pod of the fleet's Deployment (or, with `name`/`extra_labels`, of a group)."""
    pod_labels = {**labels(fleet, ENGINE, ENGINE_APP), **(extra_labels or {"pod-template-hash": "7d9c5f6b8"})}
    return pod(
        name or f"{fleet.metadata.name}-engine-7d9c5f6b8-{suffix}",
        pod_labels,
        containers=[vllm if vllm is not None else running("vllm", f"docker.io/{ENGINE_IMAGE}")],
        ip=ip,
        node=node,
        annotations={POLICY_VERSION_ANNOTATION: version} if version is not None else None,
        **kwargs,
    )


# --- builders: workloads as their controllers report them ---------------------------------


def deployment(
    name: str,
    *,
    replicas: int,
    generation: int = 1,
    observed_generation: int | None = None,
    status_replicas: int | None = None,
    updated: int | None = None,
    ready: int = 0,
    progressing: tuple[str, str, str] = ("True", "NewReplicaSetAvailable", ""),
) -> dict[str, Any]:
    """A Deployment; zero counters are omitted, as the API server does (`omitempty`)."""
    status_replicas = replicas if status_replicas is None else status_replicas
    updated = status_replicas if updated is None else updated
    counters = {
        "replicas": status_replicas,
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "unavailableReplicas": max(status_replicas - ready, 0),
    }
    available = ready >= replicas
    p_status, p_reason, p_message = progressing
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": NS,
            "generation": generation,
            "annotations": {"deployment.kubernetes.io/revision": "1", HASH_ANNOTATION: "0f3c9e2a71b4d6e8"},
        },
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": generation if observed_generation is None else observed_generation,
            **{k: v for k, v in counters.items() if v},
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if available else "False",
                    "reason": "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                    "message": "Deployment has minimum availability."
                    if available
                    else "Deployment does not have minimum availability.",
                    "lastUpdateTime": ts(NOW - timedelta(minutes=5)),
                    "lastTransitionTime": ts(NOW - timedelta(minutes=5)),
                },
                {
                    "type": "Progressing",
                    "status": p_status,
                    "reason": p_reason,
                    "message": p_message or f'ReplicaSet "{name}-7d9c5f6b8" has successfully progressed.',
                    "lastUpdateTime": ts(NOW - timedelta(minutes=5)),
                    "lastTransitionTime": ts(NOW - timedelta(minutes=5)),
                },
            ],
        },
    }


def daemon_set(
    pool: SandboxPool, chunk: int, images: list[str], *, desired: int, ready: int = 0, observed: int = 1
) -> dict[str, Any]:
    """A pre-pull DaemonSet as rendered (image list annotation) with the controller's counters."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": f"{pool.metadata.name}-prepull-{chunk}",
            "namespace": NS,
            "generation": 1,
            "annotations": {
                "legorl.dev/images": json.dumps(images, separators=(",", ":")),
                "deprecated.daemonset.template.generation": "1",
                HASH_ANNOTATION: "a1b2c3d4e5f60718",
            },
        },
        "spec": {"selector": {"matchLabels": {"legorl.dev/chunk": str(chunk)}}},
        "status": {
            "currentNumberScheduled": desired,
            "desiredNumberScheduled": desired,
            "numberMisscheduled": 0,
            "numberReady": ready,
            "observedGeneration": observed,
            "updatedNumberScheduled": desired,
            **({"numberAvailable": ready} if ready else {}),
            **({"numberUnavailable": desired - ready} if desired - ready else {}),
        },
    }


def prepull_pod(
    pool: SandboxPool, node: str, init: list[dict[str, Any]], *, chunk: int = 0, done: bool = False
) -> dict[str, Any]:
    pod_labels = {
        **labels(pool, PREPULL, "legorl-prepull"),
        "legorl.dev/chunk": str(chunk),
        "controller-revision-hash": "6b7f9d5c4",
        "pod-template-generation": "1",
    }
    pause = (
        running("pause", PAUSE)
        if done
        else waiting("pause", PAUSE, "PodInitializing")  # the kubelet's word for "init not done"
    )
    return pod(
        f"{pool.metadata.name}-prepull-{chunk}-{node[-5:]}",
        pod_labels,
        containers=[pause],
        init_containers=init,
        node=node,
        ip=f"10.42.{len(node)}.9",
        phase="Running" if done else "Pending",
        conditions=None if done else pod_conditions(ready=False, initialized=False, unready="pause"),
    )


def job(name: str, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS, "generation": 1},
        "spec": {"suspend": False, "backoffLimit": 6, "completions": 2, "parallelism": 2},
        "status": {"startTime": ts(NOW - timedelta(hours=1)), **status},
    }


def observe(*bodies: dict[str, Any]) -> Observed:
    """What the operator's indexes hold for these bodies."""
    observed = Observed()
    for body in bodies:
        if body["kind"] == "Pod":
            observed.pods.append(pod_view(body))
        else:
            view = child_view(body)
            observed.children[(view.kind, view.name)] = view
    return observed


def cond(conditions: list[Condition], type_: str) -> Condition:
    found = find_condition(conditions, type_)
    assert found is not None, f"no {type_} condition in {[c.type for c in conditions]}"
    return found


def reasons(conditions: list[Condition]) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in conditions}


# === RolloutFleet ==========================================================================


def test_fleet_nothing_exists_yet() -> None:
    fleet = make_fleet()
    status = compute_fleet_status(fleet, Observed(), NOW)
    assert reasons(status.conditions) == {
        "Ready": ("False", "ReplicasNotReady"),
        "Progressing": ("True", "RolloutInProgress"),
        "Degraded": ("False", "AsExpected"),
    }
    assert "0/2 replicas ready" in cond(status.conditions, "Ready").message
    assert "being created" in cond(status.conditions, "Progressing").message
    assert (status.replicas, status.ready_replicas, status.endpoints) == (0, 0, [])
    assert status.served_policy_version is None
    assert all(c.last_transition_time == STAMP for c in status.conditions)
    assert all(c.observed_generation == 2 for c in status.conditions)


def test_fleet_all_replicas_ready_reports_endpoints_and_the_initial_version() -> None:
    fleet = make_fleet(generation=3)
    observed = observe(
        deployment("coder-fleet-engine", replicas=2, ready=2),
        engine_pod(fleet, "x2kqp", ip="10.42.1.17"),
        engine_pod(fleet, "b7wzt", ip="10.42.2.31", node="gpu-node-2"),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    assert reasons(status.conditions) == {
        "Progressing": ("False", "RolloutComplete"),
        "Ready": ("True", "AllReplicasReady"),
        "Degraded": ("False", "AsExpected"),
    }
    assert cond(status.conditions, "Ready").message == "2/2 replicas serve policy version 0"
    assert (status.replicas, status.ready_replicas) == (2, 2)
    assert status.served_policy_version == "0"
    assert [(e.name, e.url, e.ready, e.policy_version) for e in status.endpoints] == [
        ("coder-fleet-engine-7d9c5f6b8-b7wzt", "http://10.42.2.31:8000/v1", True, "0"),
        ("coder-fleet-engine-7d9c5f6b8-x2kqp", "http://10.42.1.17:8000/v1", True, "0"),
    ]
    assert status.observed_generation == 3
    assert {c.observed_generation for c in status.conditions} == {3}
    assert status.selector == "legorl.dev/component=engine,legorl.dev/owner=rolloutfleet.coder-fleet"
    # The status survives the API server's round trip as the next reconcile will see it.
    assert fed_back(fleet, status).status == status


def test_fleet_selector_matches_the_engine_pods() -> None:
    fleet = make_fleet()
    status = compute_fleet_status(fleet, Observed(), NOW)
    pod_labels = engine_pod(fleet, "x2kqp")["metadata"]["labels"]
    terms = dict(term.split("=", 1) for term in status.selector.split(","))
    assert terms.items() <= pod_labels.items()
    # An HPA selects with it: it must not match the pool's or the trainer's pods.
    assert terms["legorl.dev/component"] == "engine"


def test_fleet_served_version_comes_from_the_policy_version_annotation() -> None:
    fleet = make_fleet(port=8100)
    observed = observe(
        deployment("coder-fleet-engine", replicas=2, ready=2),
        engine_pod(fleet, "x2kqp", ip="10.42.1.17", version="17"),
        engine_pod(fleet, "b7wzt", ip="10.42.2.31", version="17"),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    assert status.served_policy_version == "17"
    assert {e.policy_version for e in status.endpoints} == {"17"}
    assert {e.url for e in status.endpoints} == {"http://10.42.1.17:8100/v1", "http://10.42.2.31:8100/v1"}
    assert cond(status.conditions, "Ready").message == "2/2 replicas serve policy version 17"


def test_fleet_running_but_not_ready_pods_are_loading_the_model() -> None:
    fleet = make_fleet(startupSeconds=2400)
    loading = running("vllm", f"docker.io/{ENGINE_IMAGE}", ready=False)
    observed = observe(
        deployment(
            "coder-fleet-engine",
            replicas=2,
            ready=1,
            progressing=(
                "True",
                "ReplicaSetUpdated",
                'ReplicaSet "coder-fleet-engine-7d9c5f6b8" is progressing.',
            ),
        ),
        engine_pod(fleet, "x2kqp"),
        engine_pod(fleet, "b7wzt", vllm=loading, ip="10.42.2.31"),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    ready = cond(status.conditions, "Ready")
    assert (ready.status, ready.reason) == ("False", "ModelLoading")
    assert "1/2 replicas ready" in ready.message
    assert "coder-fleet-engine-7d9c5f6b8-b7wzt running and loading the model" in ready.message
    assert "2400s" in ready.message
    assert cond(status.conditions, "Degraded").status == "False"
    assert status.ready_replicas == 1
    # Not-ready replicas are listed (with an IP) but marked not ready; only ready ones set the version.
    assert [(e.name[-5:], e.ready) for e in status.endpoints] == [("b7wzt", False), ("x2kqp", True)]
    assert status.served_policy_version == "0"


def test_fleet_image_pull_failure_degrades_naming_the_image() -> None:
    fleet = make_fleet(engine={"image": "vllm/vllm-openai:v0.99.0"})
    pull = waiting(
        "vllm",
        "vllm/vllm-openai:v0.99.0",
        "ImagePullBackOff",
        'Back-off pulling image "vllm/vllm-openai:v0.99.0"',
    )
    observed = observe(
        deployment("coder-fleet-engine", replicas=2),
        engine_pod(fleet, "x2kqp", vllm=pull, ip="10.42.1.17", phase="Pending"),
        engine_pod(fleet, "b7wzt", vllm=pull, ip="10.42.2.31", phase="Pending"),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    degraded = cond(status.conditions, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ImagePullFailed")
    assert "cannot pull vllm/vllm-openai:v0.99.0 (ImagePullBackOff)" in degraded.message
    assert 'Back-off pulling image "vllm/vllm-openai:v0.99.0"' in degraded.message
    assert "(and 1 more pods)" in degraded.message
    ready = cond(status.conditions, "Ready")
    assert (ready.status, ready.reason) == ("False", "ReplicasNotReady")
    assert "0/2 replicas ready" in ready.message
    assert "cannot pull vllm/vllm-openai:v0.99.0" in ready.message


def test_fleet_err_image_pull_is_a_pull_failure_too() -> None:
    fleet = make_fleet(replicas=1)
    message = (
        'rpc error: code = NotFound desc = failed to pull and unpack image "docker.io/vllm/vllm-openai:v9": '
        'failed to resolve reference "docker.io/vllm/vllm-openai:v9": not found'
    )
    observed = observe(
        deployment("coder-fleet-engine", replicas=1),
        engine_pod(fleet, "x2kqp", vllm=waiting("vllm", "vllm/vllm-openai:v9", "ErrImagePull", message)),
    )
    degraded = cond(compute_fleet_status(fleet, observed, NOW).conditions, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ImagePullFailed")
    assert "vllm/vllm-openai:v9 (ErrImagePull): rpc error: code = NotFound" in degraded.message
    assert "(and" not in degraded.message


def test_fleet_crash_loop_degrades_with_restart_count_and_last_exit() -> None:
    fleet = make_fleet(replicas=1)
    crash = waiting(
        "vllm",
        f"docker.io/{ENGINE_IMAGE}",
        "CrashLoopBackOff",
        "back-off 5m0s restarting failed container=vllm "
        "pod=coder-fleet-engine-7d9c5f6b8-x2kqp_rl-research(uid-coder-fleet-engine-7d9c5f6b8-x2kqp)",
        restarts=7,
        last_terminated={
            "exitCode": 137,
            "reason": "OOMKilled",
            "startedAt": ts(NOW - timedelta(minutes=6)),
            "finishedAt": ts(NOW - timedelta(minutes=5)),
        },
    )
    observed = observe(
        deployment("coder-fleet-engine", replicas=1),
        engine_pod(fleet, "x2kqp", vllm=crash),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    degraded = cond(status.conditions, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "CrashLoop")
    assert (
        "container vllm of pod coder-fleet-engine-7d9c5f6b8-x2kqp is in CrashLoopBackOff after 7 restarts"
        in degraded.message
    )
    assert "back-off 5m0s" in degraded.message
    # FleetReason.CRASH_LOOP: "the message carries its last termination reason".
    assert "OOMKilled (137)" in degraded.message
    assert cond(status.conditions, "Ready").reason == "ReplicasNotReady"


def test_fleet_unschedulable_pod_carries_the_scheduler_message() -> None:
    fleet = make_fleet(replicas=1)
    scheduler = (
        "0/6 nodes are available: 2 node(s) had untolerated taint {nvidia.com/gpu: present}, "
        "4 Insufficient nvidia.com/gpu. preemption: 0/6 nodes are available: "
        "2 Preemption is not helpful for scheduling, 4 No preemption victims found for incoming pod."
    )
    pending = engine_pod(
        fleet,
        "x2kqp",
        vllm=waiting("vllm", ENGINE_IMAGE, "ContainerCreating"),
        phase="Pending",
        conditions=pod_conditions(ready=False, unschedulable=scheduler),
    )
    assert "containerStatuses" not in pending["status"]  # the kubelet never saw it
    status = compute_fleet_status(fleet, observe(deployment("coder-fleet-engine", replicas=1), pending), NOW)
    degraded = cond(status.conditions, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "Unschedulable")
    assert "pod coder-fleet-engine-7d9c5f6b8-x2kqp cannot be scheduled" in degraded.message
    assert "4 Insufficient nvidia.com/gpu" in degraded.message
    assert status.endpoints == []  # no IP yet
    assert status.replicas == 1


def test_fleet_progress_deadline_exceeded() -> None:
    fleet = make_fleet(replicas=1, startupSeconds=1800)
    gave_up = 'ReplicaSet "coder-fleet-engine-7d9c5f6b8" has timed out progressing.'
    observed = observe(
        deployment(
            "coder-fleet-engine", replicas=1, progressing=("False", "ProgressDeadlineExceeded", gave_up)
        ),
        engine_pod(fleet, "x2kqp", vllm=running("vllm", f"docker.io/{ENGINE_IMAGE}", ready=False)),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    progressing = cond(status.conditions, "Progressing")
    assert (progressing.status, progressing.reason, progressing.message) == (
        "False",
        "ProgressDeadlineExceeded",
        gave_up,
    )
    degraded = cond(status.conditions, "Degraded")
    assert (degraded.status, degraded.reason, degraded.message) == (
        "True",
        "ProgressDeadlineExceeded",
        gave_up,
    )
    assert cond(status.conditions, "Ready").status == "False"


def test_fleet_pod_problems_outrank_the_progress_deadline() -> None:
    fleet = make_fleet(replicas=1)
    observed = observe(
        deployment(
            "coder-fleet-engine",
            replicas=1,
            progressing=("False", "ProgressDeadlineExceeded", "has timed out progressing."),
        ),
        engine_pod(fleet, "x2kqp", vllm=waiting("vllm", ENGINE_IMAGE, "ErrImagePull", "not found")),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    assert cond(status.conditions, "Degraded").reason == "ImagePullFailed"
    assert cond(status.conditions, "Progressing").reason == "ProgressDeadlineExceeded"


def test_fleet_scaled_to_zero() -> None:
    fleet = make_fleet(replicas=0)
    observed = observe(deployment("coder-fleet-engine", replicas=0))
    status = compute_fleet_status(fleet, observed, NOW)
    assert reasons(status.conditions) == {
        "Progressing": ("False", "RolloutComplete"),
        "Ready": ("False", "ScaledToZero"),
        "Degraded": ("False", "AsExpected"),
    }
    assert "spec.replicas is 0" in cond(status.conditions, "Ready").message
    assert (status.replicas, status.ready_replicas, status.served_policy_version) == (0, 0, None)


def test_fleet_old_replicas_shutting_down_are_a_rollout() -> None:
    fleet = make_fleet(replicas=2, generation=4)
    observed = observe(
        deployment("coder-fleet-engine", replicas=2, generation=4, status_replicas=3, updated=2, ready=2),
        engine_pod(fleet, "x2kqp"),
        engine_pod(fleet, "b7wzt", ip="10.42.2.31"),
        engine_pod(fleet, "old01", ip="10.42.3.8", deleting=True),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    progressing = cond(status.conditions, "Progressing")
    assert (progressing.status, progressing.reason) == ("True", "RolloutInProgress")
    assert "1 old replicas are shutting down" in progressing.message
    # The terminating pod is neither a replica nor an endpoint.
    assert (status.replicas, status.ready_replicas) == (2, 2)
    assert all("old01" not in e.name for e in status.endpoints)


def test_fleet_controller_behind_the_template_is_a_rollout() -> None:
    fleet = make_fleet(replicas=1, generation=5)
    observed = observe(
        deployment("coder-fleet-engine", replicas=1, generation=5, observed_generation=4, ready=1),
        engine_pod(fleet, "x2kqp"),
    )
    progressing = cond(compute_fleet_status(fleet, observed, NOW).conditions, "Progressing")
    assert (progressing.status, progressing.reason) == ("True", "RolloutInProgress")
    assert "has not seen the latest template" in progressing.message


def test_fleet_version_skew_is_a_weight_sync_then_degrades_after_the_timeout() -> None:
    fleet = make_fleet(weightSync={"method": "Filesystem", "timeoutSeconds": 300})
    bodies = (
        deployment("coder-fleet-engine", replicas=2, ready=2),
        engine_pod(fleet, "x2kqp", ip="10.42.1.17", version="12"),
        engine_pod(fleet, "b7wzt", ip="10.42.2.31", version="11"),
    )
    first = compute_fleet_status(fleet, observe(*bodies), NOW)
    progressing = cond(first.conditions, "Progressing")
    assert (progressing.status, progressing.reason) == ("True", "WeightSyncInProgress")
    assert progressing.message == "ready replicas serve policy versions 11, 12"
    assert first.served_policy_version is None
    assert cond(first.conditions, "Ready").message == "2/2 replicas serve"
    assert reasons(first.conditions)["Degraded"] == ("False", "AsExpected")

    # Within the timeout: still a sync in progress.
    fleet = fed_back(fleet, first)
    second = compute_fleet_status(fleet, observe(*bodies), NOW + timedelta(seconds=300))
    assert reasons(second.conditions)["Degraded"] == ("False", "AsExpected")
    assert cond(second.conditions, "Progressing").last_transition_time == STAMP

    fleet = fed_back(fleet, second)
    later = NOW + timedelta(seconds=301)
    third = compute_fleet_status(fleet, observe(*bodies), later)
    degraded = cond(third.conditions, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "PolicyVersionSkew")
    assert "11, 12" in degraded.message
    assert "weightSync.timeoutSeconds (300s)" in degraded.message
    assert "restart the lagging replicas" in degraded.message
    assert degraded.last_transition_time == ts(later)

    # The lagging replica catches up: the skew clears and Degraded moves back.
    caught_up = (bodies[0], bodies[1], engine_pod(fleet, "b7wzt", ip="10.42.2.31", version="12"))
    fourth = compute_fleet_status(fed_back(fleet, third), observe(*caught_up), later + timedelta(seconds=5))
    assert reasons(fourth.conditions)["Degraded"] == ("False", "AsExpected")
    assert reasons(fourth.conditions)["Progressing"] == ("False", "RolloutComplete")
    assert fourth.served_policy_version == "12"
    assert cond(fourth.conditions, "Degraded").last_transition_time == ts(later + timedelta(seconds=5))


def test_fleet_version_skew_is_timed_from_its_own_start_not_the_rollout() -> None:
    fleet = make_fleet(weightSync={"method": "Filesystem", "timeoutSeconds": 300})
    # A long rollout first: Progressing is True (RolloutInProgress) from NOW.
    rolling = compute_fleet_status(fleet, observe(), NOW)
    assert reasons(rolling.conditions)["Progressing"] == ("True", "RolloutInProgress")
    assert rolling.version_skew_since is None
    # Twenty minutes later the replicas are up but disagree: a sync that has only just begun.
    later = NOW + timedelta(minutes=20)
    bodies = (
        deployment("coder-fleet-engine", replicas=2, ready=2),
        engine_pod(fleet, "x2kqp", ip="10.42.1.17", version="3"),
        engine_pod(fleet, "b7wzt", ip="10.42.2.31", version="2"),
    )
    skewed = compute_fleet_status(fed_back(fleet, rolling), observe(*bodies), later)
    assert reasons(skewed.conditions)["Progressing"] == ("True", "WeightSyncInProgress")
    assert reasons(skewed.conditions)["Degraded"] == ("False", "AsExpected")
    assert skewed.version_skew_since == ts(later)
    still = compute_fleet_status(fed_back(fleet, skewed), observe(*bodies), later + timedelta(seconds=301))
    assert reasons(still.conditions)["Degraded"] == ("True", "PolicyVersionSkew")
    assert still.version_skew_since == ts(later)


def test_fleet_render_error_is_invalid_spec() -> None:
    fleet = make_fleet(model={"uri": "builtin://tiny-moe"})
    error = "spec.model.uri: 'builtin://tiny-moe': builtin:// models exist only in local runs"
    status = compute_fleet_status(fleet, Observed(), NOW, render_error=error)
    assert reasons(status.conditions) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert {c.message for c in status.conditions} == {error}
    assert status.observed_generation == 2
    assert status.selector == "legorl.dev/component=engine,legorl.dev/owner=rolloutfleet.coder-fleet"


def test_fleet_render_error_keeps_what_was_last_observed() -> None:
    fleet = make_fleet(replicas=1)
    healthy = compute_fleet_status(
        fleet,
        observe(deployment("coder-fleet-engine", replicas=1, ready=1), engine_pod(fleet, "x2kqp")),
        NOW,
    )
    broken = make_fleet(replicas=1, generation=3, status=healthy.to_wire())
    later = NOW + timedelta(minutes=10)
    status = compute_fleet_status(broken, Observed(), later, render_error="spec.model.uri: bad")
    assert status.endpoints == healthy.endpoints
    assert status.observed_generation == 3
    ready = cond(status.conditions, "Ready")
    assert (ready.reason, ready.last_transition_time, ready.observed_generation) == (
        "InvalidSpec",
        ts(later),
        3,
    )
    # Progressing was already False (RolloutComplete): its transition time stays.
    assert cond(status.conditions, "Progressing").last_transition_time == STAMP


def _group_pod(fleet: RolloutFleet, replica: int, index: int, *, ready: bool, ip: str) -> dict[str, Any]:
    """A pod of the StatefulSet of one replica group (no LeaderWorkerSet installed)."""
    sts = f"{fleet.metadata.name}-engine-{replica}"
    return engine_pod(
        fleet,
        "",
        name=f"{sts}-{index}",
        ip=ip,
        node=f"gpu-node-{replica}{index}",
        vllm=running("vllm", f"docker.io/{ENGINE_IMAGE}", ready=ready),
        extra_labels={
            "legorl.dev/replica": str(replica),
            "apps.kubernetes.io/pod-index": str(index),
            "statefulset.kubernetes.io/pod-name": f"{sts}-{index}",
            "controller-revision-hash": f"{sts}-5d8f7c9b6",
        },
    )


MULTI_NODE = {"gpusPerNode": 8, "nodesPerReplica": 2, "tensorParallelSize": 8, "pipelineParallelSize": 2}


def test_fleet_multi_node_group_is_ready_only_when_every_pod_is() -> None:
    fleet = make_fleet(parallelism=MULTI_NODE)
    observed = observe(
        _group_pod(fleet, 0, 0, ready=True, ip="10.42.1.10"),
        _group_pod(fleet, 0, 1, ready=True, ip="10.42.1.11"),
        _group_pod(fleet, 1, 0, ready=True, ip="10.42.2.10"),
        _group_pod(fleet, 1, 1, ready=False, ip="10.42.2.11"),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    assert (status.replicas, status.ready_replicas) == (2, 1)
    # One endpoint per group: its leader (ordinal 0), never a worker.
    assert [(e.name, e.url, e.ready) for e in status.endpoints] == [
        ("coder-fleet-engine-0-0", "http://10.42.1.10:8000/v1", True),
        ("coder-fleet-engine-1-0", "http://10.42.2.10:8000/v1", False),
    ]
    ready = cond(status.conditions, "Ready")
    assert (ready.status, ready.reason) == ("False", "ModelLoading")
    assert "1/2 replicas ready" in ready.message
    assert "coder-fleet-engine-1-1" in ready.message
    assert reasons(status.conditions)["Progressing"] == ("False", "RolloutComplete")

    all_ready = observe(
        *(_group_pod(fleet, r, i, ready=True, ip=f"10.42.{r}.{i}") for r in (0, 1) for i in (0, 1))
    )
    status = compute_fleet_status(fed_back(fleet, status), all_ready, NOW + timedelta(minutes=1))
    assert reasons(status.conditions)["Ready"] == ("True", "AllReplicasReady")
    assert status.ready_replicas == 2
    assert status.served_policy_version == "0"


def test_fleet_multi_node_missing_groups_are_a_rollout() -> None:
    fleet = make_fleet(parallelism=MULTI_NODE)
    observed = observe(
        _group_pod(fleet, 0, 0, ready=True, ip="10.42.1.10"),
        _group_pod(fleet, 0, 1, ready=True, ip="10.42.1.11"),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    progressing = cond(status.conditions, "Progressing")
    assert (progressing.status, progressing.reason, progressing.message) == (
        "True",
        "RolloutInProgress",
        "1/2 replica groups exist",
    )
    assert reasons(status.conditions)["Ready"] == ("False", "ReplicasNotReady")
    assert status.ready_replicas == 1


def _lws_pod(fleet: RolloutFleet, group: int, worker: int, *, ready: bool, ip: str) -> dict[str, Any]:
    """A pod of a LeaderWorkerSet group as LWS labels it. The leader of group g is ordinal g of
    the leader StatefulSet; the workers are ordinals 1.. of the group's worker StatefulSet."""
    lws = f"{fleet.metadata.name}-engine"
    name = f"{lws}-{group}" if worker == 0 else f"{lws}-{group}-{worker}"
    return engine_pod(
        fleet,
        "",
        name=name,
        ip=ip,
        node=f"gpu-node-{group}{worker}",
        vllm=running("vllm", f"docker.io/{ENGINE_IMAGE}", ready=ready),
        extra_labels={
            "leaderworkerset.sigs.k8s.io/name": lws,
            "leaderworkerset.sigs.k8s.io/group-index": str(group),
            "leaderworkerset.sigs.k8s.io/group-key": f"{group:040x}",
            "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
            "leaderworkerset.sigs.k8s.io/template-revision-hash": "5c5fcdfb44",
            "apps.kubernetes.io/pod-index": str(group if worker == 0 else worker),
            "statefulset.kubernetes.io/pod-name": name,
        },
    )


def test_fleet_multi_node_leader_worker_set_groups() -> None:
    fleet = make_fleet(parallelism=MULTI_NODE)
    observed = observe(
        _lws_pod(fleet, 0, 0, ready=True, ip="10.42.1.10"),
        _lws_pod(fleet, 0, 1, ready=True, ip="10.42.1.11"),
        _lws_pod(fleet, 1, 0, ready=True, ip="10.42.2.10"),
        _lws_pod(fleet, 1, 1, ready=True, ip="10.42.2.11"),
    )
    status = compute_fleet_status(fleet, observed, NOW)
    assert (status.replicas, status.ready_replicas) == (2, 2)
    assert [(e.name, e.url) for e in status.endpoints] == [
        ("coder-fleet-engine-0", "http://10.42.1.10:8000/v1"),
        ("coder-fleet-engine-1", "http://10.42.2.10:8000/v1"),
    ]
    assert reasons(status.conditions)["Ready"] == ("True", "AllReplicasReady")


def test_fleet_last_transition_time_moves_only_when_status_changes() -> None:
    fleet = make_fleet(replicas=1)
    loading = observe(
        deployment("coder-fleet-engine", replicas=1),
        engine_pod(fleet, "x2kqp", vllm=running("vllm", f"docker.io/{ENGINE_IMAGE}", ready=False)),
    )
    first = compute_fleet_status(fleet, loading, NOW)
    assert reasons(first.conditions)["Ready"] == ("False", "ModelLoading")

    t1 = NOW + timedelta(minutes=3)
    second = compute_fleet_status(fed_back(fleet, first), loading, t1)
    assert second == first  # nothing changed: not even a timestamp (no status write)

    t2 = NOW + timedelta(minutes=7)
    up = observe(deployment("coder-fleet-engine", replicas=1, ready=1), engine_pod(fleet, "x2kqp"))
    third = compute_fleet_status(fed_back(fleet, second), up, t2)
    ready = cond(third.conditions, "Ready")
    assert (ready.status, ready.reason, ready.last_transition_time) == ("True", "AllReplicasReady", ts(t2))
    # Progressing and Degraded kept their status: their times stay at the first reconcile.
    assert cond(third.conditions, "Progressing").last_transition_time == STAMP
    assert cond(third.conditions, "Degraded").last_transition_time == STAMP
    # The order of conditions is stable across reconciles (no spurious status patches).
    assert [c.type for c in third.conditions] == [c.type for c in first.conditions]


def test_fleet_weights_owner_is_kept() -> None:
    fleet = make_fleet(status=RolloutFleetStatus(weights_owner="coder-grpo").to_wire())
    assert compute_fleet_status(fleet, Observed(), NOW).weights_owner == "coder-grpo"


# === SandboxPool ===========================================================================


def _pool_status(
    pool: SandboxPool, *bodies: dict[str, Any], images: list[str] | None = None
) -> SandboxPoolStatus:
    return compute_pool_status(
        pool, observe(*bodies), NOW, task_set_images=images or [], pod_template_hash="4be1f0c2a9d3"
    )


PULL_ERROR = (
    'rpc error: code = NotFound desc = failed to pull and unpack image "ghcr.io/example/swe-tasks/'
    'sympy-20590:v1": failed to resolve reference "ghcr.io/example/swe-tasks/sympy-20590:v1": not found'
)


def test_pool_images_are_pulling() -> None:
    pool = make_pool()
    status = _pool_status(
        pool,
        daemon_set(pool, 0, [DJANGO, SYMPY], desired=2),
        # node a: pull-0 done, pull-1 running (the kubelet started it: the image is there)
        prepull_pod(pool, "node-a", [terminated("pull-0", DJANGO), running("pull-1", SYMPY, ready=False)]),
        # node b: still pulling the first image
        prepull_pod(
            pool,
            "node-b",
            [waiting("pull-0", DJANGO, "PodInitializing"), waiting("pull-1", SYMPY, "PodInitializing")],
        ),
    )
    images = cond(status.conditions, "ImagesCached")
    assert (images.status, images.reason, images.message) == (
        "False",
        "PullInProgress",
        "2/4 image × node pulls done",
    )
    assert [(n.name, n.desired, n.pulled, n.failed) for n in status.nodes] == [
        ("node-a", 2, 2, 0),
        ("node-b", 2, 0, 0),
    ]
    assert (status.images_desired, status.images_cached) == (2, 0)
    # Pulling does not block trials (they pull what is missing); nothing is wrong.
    ready = cond(status.conditions, "Ready")
    assert (ready.status, ready.reason) == ("True", "PoolReady")
    assert "images: 2/4 image × node pulls done" in ready.message
    assert reasons(status.conditions)["Degraded"] == ("False", "AsExpected")


def test_pool_all_images_cached() -> None:
    pool = make_pool()
    init = [terminated("pull-0", DJANGO), terminated("pull-1", SYMPY)]
    status = _pool_status(
        pool,
        daemon_set(pool, 0, [DJANGO, SYMPY], desired=2, ready=2),
        prepull_pod(pool, "node-a", init, done=True),
        prepull_pod(pool, "node-b", init, done=True),
    )
    images = cond(status.conditions, "ImagesCached")
    assert (images.status, images.reason, images.message) == (
        "True",
        "AllImagesCached",
        "2 image(s) on all 2 matching node(s)",
    )
    assert (status.images_desired, status.images_cached) == (2, 2)
    assert [(n.name, n.pulled, n.failures) for n in status.nodes] == [("node-a", 2, []), ("node-b", 2, [])]
    assert reasons(status.conditions)["Ready"] == ("True", "PoolReady")
    assert cond(status.conditions, "Ready").message == "trials can start"


def test_pool_images_named_by_short_references_are_matched_through_the_daemon_set() -> None:
    # The kubelet reports a Docker Hub image by its normalized name; the DaemonSet's image list
    # (annotation) says which image each pull-N init container pulls.
    pool = make_pool(source={"images": ["python:3.12-bookworm", "ubuntu:24.04"]})
    init = [
        terminated("pull-0", "docker.io/library/python:3.12-bookworm"),
        terminated("pull-1", "docker.io/library/ubuntu:24.04"),
    ]
    status = _pool_status(
        pool,
        daemon_set(pool, 0, ["python:3.12-bookworm", "ubuntu:24.04"], desired=1, ready=1),
        prepull_pod(pool, "node-a", init, done=True),
    )
    assert reasons(status.conditions)["ImagesCached"] == ("True", "AllImagesCached")
    assert status.images_cached == 2


def test_pool_pull_failure_names_the_node_and_the_image() -> None:
    pool = make_pool()
    status = _pool_status(
        pool,
        daemon_set(pool, 0, [DJANGO, SYMPY], desired=2, ready=1),
        prepull_pod(pool, "node-a", [terminated("pull-0", DJANGO), terminated("pull-1", SYMPY)], done=True),
        prepull_pod(
            pool,
            "node-b",
            [terminated("pull-0", DJANGO), waiting("pull-1", SYMPY, "ErrImagePull", PULL_ERROR)],
        ),
    )
    images = cond(status.conditions, "ImagesCached")
    assert (images.status, images.reason) == ("False", "PullFailed")
    assert images.message.startswith(f"{SYMPY} failed to pull on node node-b: ErrImagePull rpc error")
    assert "more failures" not in images.message
    degraded = cond(status.conditions, "Degraded")
    assert (degraded.status, degraded.reason, degraded.message) == ("True", "PullFailed", images.message)
    node_b = next(n for n in status.nodes if n.name == "node-b")
    assert (node_b.pulled, node_b.failed) == (1, 1)
    assert [(f.image, f.reason) for f in node_b.failures] == [(SYMPY, "ErrImagePull")]
    assert "not found" in node_b.failures[0].message
    assert next(n for n in status.nodes if n.name == "node-a").failures == []
    assert status.images_cached == 1  # django is on both nodes


def test_pool_image_without_a_shell_is_reported_not_pulled_forever() -> None:
    pool = make_pool()
    no_shell = waiting(
        "pull-0",
        DJANGO,
        "CrashLoopBackOff",
        "back-off 40s restarting failed container=pull-0",
        restarts=3,
        last_terminated={"exitCode": 128, "reason": "StartError", "message": 'exec: "/bin/sh": not found'},
    )
    status = _pool_status(
        pool,
        daemon_set(pool, 0, [DJANGO, SYMPY], desired=1, ready=0),
        prepull_pod(pool, "node-a", [no_shell, waiting("pull-1", SYMPY, "PodInitializing")]),
    )
    images = cond(status.conditions, "ImagesCached")
    assert (images.status, images.reason) == ("False", "PullFailed")
    assert "cannot run /bin/sh; later images of this DaemonSet are not pulled" in images.message
    (node,) = status.nodes
    assert (node.pulled, node.failed) == (1, 1)  # the image itself is on the node
    assert node.failures[0].reason == "CrashLoopBackOff"
    assert 'exec: "/bin/sh": not found' in node.failures[0].message


def test_pool_no_matching_nodes() -> None:
    pool = make_pool(placement={"nodeSelector": {"legorl.dev/sandbox": "true"}})
    status = _pool_status(pool, daemon_set(pool, 0, [DJANGO, SYMPY], desired=0))
    assert reasons(status.conditions) == {
        "ImagesCached": ("False", "NoMatchingNodes"),
        "DefensesVerified": ("Unknown", "SelfTestPending"),
        "Ready": ("False", "NoMatchingNodes"),
        "Degraded": ("True", "NoMatchingNodes"),
    }
    assert "no node matches placement.nodeSelector" in cond(status.conditions, "Ready").message
    assert status.nodes == []


def test_pool_daemon_set_not_yet_seen_by_its_controller_is_not_no_matching_nodes() -> None:
    pool = make_pool()
    fresh = daemon_set(pool, 0, [DJANGO, SYMPY], desired=0, observed=0)
    del fresh["status"]["observedGeneration"]
    status = _pool_status(pool, fresh)
    assert reasons(status.conditions)["ImagesCached"] == ("False", "PullInProgress")
    assert reasons(status.conditions)["Degraded"] == ("False", "AsExpected")


def test_pool_prepull_never() -> None:
    pool = make_pool(prePull={"policy": "Never"})
    status = _pool_status(pool)
    images = cond(status.conditions, "ImagesCached")
    assert (images.status, images.reason) == ("False", "PrePullDisabled")
    assert "prePull.policy is Never" in images.message
    ready = cond(status.conditions, "Ready")
    assert (ready.status, ready.reason) == ("True", "PoolReady")
    assert "prePull.policy is Never" in ready.message
    assert reasons(status.conditions)["Degraded"] == ("False", "AsExpected")
    assert (status.images_desired, status.images_cached) == (0, 0)


@pytest.mark.parametrize(
    ("defenses", "expected", "words"),
    [
        ({"egress": "Unrestricted"}, ("False", "DefensesRelaxedBySpec"), "defenses.egress is Unrestricted"),
        ({"gitHistory": "Preserve"}, ("False", "DefensesRelaxedBySpec"), "defenses.gitHistory is Preserve"),
        ({}, ("Unknown", "SelfTestPending"), "no probe sandbox has run yet"),
    ],
)
def test_pool_defenses(defenses: dict[str, str], expected: tuple[str, str], words: str) -> None:
    pool = make_pool(defenses=defenses, prePull={"policy": "Never"})
    status = _pool_status(pool)
    verified = cond(status.conditions, "DefensesVerified")
    assert (verified.status, verified.reason) == expected
    assert words in verified.message
    if expected[0] == "False":
        assert "not hack-proof" in verified.message
    # A relaxed or untested defense is reported, not blocking: trials self-test and fail closed.
    assert reasons(status.conditions)["Ready"] == ("True", "PoolReady")


def test_pool_failed_self_test_blocks_trials() -> None:
    previous = SandboxPoolStatus.model_validate(
        {
            "selfTest": {
                "result": "Failed",
                "checkedAt": "2026-11-30T11:58:00Z",
                "checks": [
                    {"name": "egress-refused", "result": "Failed", "message": "connected to 1.1.1.1:443"},
                    {"name": "history-single-commit", "result": "Passed"},
                ],
            }
        }
    )
    pool = make_pool(prePull={"policy": "Never"}, status=previous.to_wire())
    status = _pool_status(pool)
    assert reasons(status.conditions)["DefensesVerified"] == ("False", "SelfTestFailed")
    assert "egress-refused: connected to 1.1.1.1:443" in cond(status.conditions, "DefensesVerified").message
    assert reasons(status.conditions)["Ready"] == ("False", "SelfTestFailed")
    assert reasons(status.conditions)["Degraded"] == ("True", "SelfTestFailed")
    assert status.self_test == previous.self_test


def _warm_pod(pool: SandboxPool, suffix: str, *, ready: bool, leased: bool = False) -> dict[str, Any]:
    pod_labels = {**labels(pool, WARM, SANDBOX_APP), "pod-template-hash": "58f6d9c7b"}
    if leased:
        pod_labels["legorl.dev/leased"] = "true"
    return pod(
        f"{pool.metadata.name}-warm-58f6d9c7b-{suffix}",
        pod_labels,
        containers=[running("sandbox", DJANGO, ready=ready)],
        node="node-a",
        ip=f"10.42.7.{len(suffix)}",
    )


def test_pool_warm_capacity_not_ready() -> None:
    pool = make_pool(source={"images": [DJANGO]}, replicas=2)
    init = [terminated("pull-0", DJANGO)]
    status = _pool_status(
        pool,
        daemon_set(pool, 0, [DJANGO], desired=1, ready=1),
        prepull_pod(pool, "node-a", init, done=True),
        deployment("python-repos-warm", replicas=2, ready=1),
        _warm_pod(pool, "k2x9p", ready=True),
        _warm_pod(pool, "q8v3n", ready=False),
    )
    ready = cond(status.conditions, "Ready")
    assert (ready.status, ready.reason, ready.message) == (
        "False",
        "WarmCapacityNotReady",
        "1/2 warm sandboxes ready",
    )
    assert reasons(status.conditions)["ImagesCached"] == ("True", "AllImagesCached")
    assert reasons(status.conditions)["Degraded"] == ("False", "AsExpected")
    assert (status.replicas, status.ready_replicas, status.leased_replicas) == (2, 1, 0)
    assert status.selector == "legorl.dev/component=warm-sandbox,legorl.dev/owner=sandboxpool.python-repos"
    assert status.pod_template_hash == "4be1f0c2a9d3"
    assert status.observed_generation == 1


def test_pool_warm_capacity_ready_counts_leased_sandboxes() -> None:
    pool = make_pool(source={"images": [DJANGO]}, replicas=2, prePull={"policy": "Never"})
    status = _pool_status(
        pool, _warm_pod(pool, "k2x9p", ready=True, leased=True), _warm_pod(pool, "q8v3n", ready=True)
    )
    assert reasons(status.conditions)["Ready"] == ("True", "PoolReady")
    assert (status.ready_replicas, status.leased_replicas) == (2, 1)


def test_pool_long_kubelet_messages_fit_the_status_and_round_trip() -> None:
    # A pull through registry mirrors: containerd reports every attempt in one message.
    attempts = "; ".join(
        f'failed to do request: Head "https://{mirror}/v2/example/swe-tasks/django-11099/manifests/v1'
        '?ns=ghcr.io": '
        f"dial tcp 10.96.{i}.12:443: connect: connection refused"
        for i, mirror in enumerate(
            ["mirror-a.registry.svc:5000", "mirror-b.registry.svc:5000", "ghcr.io"] * 4
        )
    )
    message = f'rpc error: code = Unknown desc = failed to pull and unpack image "{DJANGO}": {attempts}'
    assert len(message) > 1024
    pool = make_pool()
    bodies = (
        daemon_set(pool, 0, [DJANGO, SYMPY], desired=1),
        prepull_pod(pool, "node-a", [waiting("pull-0", DJANGO, "ErrImagePull", message)]),
    )
    status = _pool_status(pool, *bodies)
    (failure,) = status.nodes[0].failures
    # Per-node detail is capped so a registry outage on many nodes cannot outgrow the object limit.
    assert failure.message == message[:MAX_FAILURE_MESSAGE]
    assert reasons(status.conditions)["ImagesCached"] == ("False", "PullFailed")
    again = compute_pool_status(
        fed_back(pool, status),
        observe(*bodies),
        NOW + timedelta(minutes=1),
        task_set_images=[],
        pod_template_hash="4be1f0c2a9d3",
    )
    assert again == status  # nothing changed: no new transition times, no status write


# === RLRun =================================================================================


def _ready_fleet(**status: Any) -> RolloutFleet:
    fleet = make_fleet()
    computed = compute_fleet_status(
        fleet,
        observe(
            deployment("coder-fleet-engine", replicas=2, ready=2),
            engine_pod(fleet, "x2kqp", ip="10.42.1.17", version="4"),
            engine_pod(fleet, "b7wzt", ip="10.42.2.31", version="4"),
        ),
        NOW,
    )
    return fed_back(fleet, computed.model_copy(update=status))


def _ready_pool() -> SandboxPool:
    pool = make_pool(prePull={"policy": "Never"})
    return fed_back(pool, _pool_status(pool))


def _run_status(
    run: RLRun,
    *bodies: dict[str, Any],
    now: datetime = NOW,
    fleet: RolloutFleet | None = None,
    pool: SandboxPool | None = None,
    problems: list[Problem] | None = None,
) -> RLRunStatus:
    return compute_run_status(
        run,
        observe(*bodies),
        now,
        fleet=fleet,
        pool=pool,
        problems=problems or [],
        store_uri="pvc://rl-store/coder-grpo/rl-research/coder-grpo",
    )


def test_run_preflight_error_is_invalid_and_starts_nothing() -> None:
    problems = [
        Problem(
            "error",
            "spec.trainer.resources.requests.memory",
            "8Gi is above the limit 4Gi; raise the limit or lower the request",
            "preflight",
        ),
        Problem("warning", "spec.fleet.engine.image", "tag 'latest' is not pinned", "preflight"),
    ]
    status = _run_status(make_run(), fleet=_ready_fleet(), pool=_ready_pool(), problems=problems)
    validated = cond(status.conditions, "Validated")
    assert (validated.status, validated.reason) == ("False", "PreflightFailed")
    assert "spec.trainer.resources.requests.memory: 8Gi is above the limit 4Gi" in validated.message
    assert "Nothing was started" in validated.message
    assert "not pinned" not in validated.message  # warnings do not block
    assert (status.phase, status.reason) == ("Invalid", "PreflightFailed")
    assert reasons(status.conditions)["Training"] == ("False", "NotStarted")
    assert reasons(status.conditions)["Failed"] == ("False", "AsExpected")
    assert status.start_time is None
    assert [(p.check, p.result) for p in status.preflight] == [
        ("preflight", "Failed"),
        ("preflight", "Warning"),
    ]
    assert status.preflight[0].message.startswith("spec.trainer.resources.requests.memory: ")


def test_run_reference_problems_only_are_reference_not_found() -> None:
    problems = [
        Problem(
            "error",
            "spec.poolRef.name",
            "SandboxPool 'python-repos' does not exist in namespace rl-research; "
            "create it or point poolRef at an existing one",
            "reference",
        )
    ]
    status = _run_status(make_run(), fleet=_ready_fleet(), pool=None, problems=problems)
    validated = cond(status.conditions, "Validated")
    assert (validated.status, validated.reason) == ("False", "ReferenceNotFound")
    assert "SandboxPool 'python-repos' does not exist" in validated.message
    assert (status.phase, status.reason) == ("Invalid", "ReferenceNotFound")
    sandboxes = cond(status.conditions, "SandboxesReady")
    assert (sandboxes.status, sandboxes.reason) == ("False", "ReferenceNotFound")
    assert "SandboxPool 'python-repos' does not exist in this namespace" in sandboxes.message


def test_run_missing_fleet() -> None:
    status = _run_status(make_run(), fleet=None, pool=_ready_pool())
    rollout = cond(status.conditions, "RolloutReady")
    assert (rollout.status, rollout.reason) == ("False", "ReferenceNotFound")
    assert "RolloutFleet 'coder-fleet' does not exist" in rollout.message
    training = cond(status.conditions, "Training")
    assert (training.status, training.reason) == ("False", "WaitingForDependencies")
    assert "waiting for the fleet to be ready" in training.message
    assert (status.phase, status.reason) == ("Pending", "ReferenceNotFound")


def test_run_fleet_not_ready_says_why() -> None:
    fleet = make_fleet()
    loading = compute_fleet_status(
        fleet,
        observe(
            deployment("coder-fleet-engine", replicas=2),
            engine_pod(fleet, "x2kqp", vllm=running("vllm", ENGINE_IMAGE, ready=False)),
            engine_pod(fleet, "b7wzt", vllm=running("vllm", ENGINE_IMAGE, ready=False), ip="10.42.2.31"),
        ),
        NOW,
    )
    status = _run_status(make_run(), fleet=fed_back(fleet, loading), pool=_ready_pool())
    rollout = cond(status.conditions, "RolloutReady")
    assert (rollout.status, rollout.reason) == ("False", "FleetNotReady")
    assert "RolloutFleet coder-fleet is not ready (ModelLoading: 0/2 replicas ready" in rollout.message
    assert (status.phase, status.reason) == ("Pending", "FleetNotReady")


def test_run_with_ready_dependencies_waits_for_the_run_controller() -> None:
    run = make_run(generation=3)
    trainer = job("coder-grpo-trainer", active=2, ready=2)
    status = _run_status(run, trainer, fleet=_ready_fleet(), pool=_ready_pool())
    assert reasons(status.conditions) == {
        "Validated": ("True", "Valid"),
        "RolloutReady": ("True", "FleetReady"),
        "SandboxesReady": ("True", "PoolReady"),
        "Failed": ("False", "AsExpected"),
        "Succeeded": ("False", "NotStarted"),
        "Training": ("False", "ControllerPending"),
        "Degraded": ("False", "AsExpected"),
    }
    assert cond(status.conditions, "RolloutReady").message == (
        "RolloutFleet coder-fleet: 2/2 replicas serve policy version 4"
    )
    assert "trainer Job coder-grpo-trainer has 2 active pod(s)" in cond(status.conditions, "Training").message
    assert "no run controller" in cond(status.conditions, "Training").message
    assert (status.phase, status.reason) == ("Pending", "ControllerPending")
    assert status.policy_version == "4"
    assert (status.fleet_name, status.pool_name) == ("coder-fleet", "python-repos")
    assert status.store_uri == "pvc://rl-store/coder-grpo/rl-research/coder-grpo"
    assert status.start_time == STAMP
    assert status.completion_time is None
    assert status.observed_generation == 3
    assert [(p.check, p.result) for p in status.preflight] == [("preflight", "Passed")]


def test_run_suspended() -> None:
    status = _run_status(make_run(suspend=True), fleet=_ready_fleet(), pool=_ready_pool())
    assert (status.phase, status.reason) == ("Suspended", "Suspended")
    training = cond(status.conditions, "Training")
    assert (training.status, training.reason) == ("False", "Suspended")
    assert "spec.suspend is true" in training.message


def test_run_active_deadline() -> None:
    run = make_run(activeDeadlineSeconds=3600)
    fleet, pool = _ready_fleet(), _ready_pool()
    first = _run_status(run, fleet=fleet, pool=pool)
    assert first.start_time == STAMP
    assert reasons(first.conditions)["Failed"] == ("False", "AsExpected")

    # Later reconciles keep the start time; at the deadline minus a second nothing has happened.
    almost = NOW + timedelta(seconds=3599)
    second = _run_status(fed_back(run, first), now=almost, fleet=fleet, pool=pool)
    assert second.start_time == STAMP
    assert reasons(second.conditions)["Failed"] == ("False", "AsExpected")
    assert second.phase == "Pending"

    passed = NOW + timedelta(seconds=3601)
    third = _run_status(fed_back(run, second), now=passed, fleet=fleet, pool=pool)
    failed = cond(third.conditions, "Failed")
    assert (failed.status, failed.reason) == ("True", "DeadlineExceeded")
    assert f"activeDeadlineSeconds (3600s) passed since {STAMP}" in failed.message
    assert "store kept" in failed.message
    assert failed.last_transition_time == ts(passed)
    assert (third.phase, third.reason) == ("Failed", "DeadlineExceeded")
    assert third.completion_time == ts(passed)
    assert reasons(third.conditions)["Training"] == ("False", "Stopped")

    # An ended run stays ended, with its completion time, whatever happens next.
    much_later = passed + timedelta(hours=5)
    fourth = _run_status(fed_back(run, third), now=much_later, fleet=fleet, pool=pool)
    assert fourth.completion_time == ts(passed)
    assert (fourth.phase, fourth.reason) == ("Failed", "DeadlineExceeded")
    assert cond(fourth.conditions, "Failed").last_transition_time == ts(passed)
    assert fourth.start_time == STAMP


def test_run_without_deadline_never_times_out() -> None:
    run = make_run()
    fleet, pool = _ready_fleet(), _ready_pool()
    first = _run_status(run, fleet=fleet, pool=pool)
    later = _run_status(fed_back(run, first), now=NOW + timedelta(days=60), fleet=fleet, pool=pool)
    assert reasons(later.conditions)["Failed"] == ("False", "AsExpected")
    assert later.completion_time is None


def test_a_trainer_pod_the_job_replaces_does_not_fail_the_run() -> None:
    """A killed trainer pod (failed=1) that the Job replaces (backoffLimit = spec.trainer.restarts): the
    new pod resumes from the store, and only the Job's own Failed condition fails the run."""
    trainer = job("coder-grpo-trainer", failed=1, active=1, conditions=[])
    status = _run_status(make_run(), trainer, fleet=_ready_fleet(), pool=_ready_pool())
    assert reasons(status.conditions)["Failed"][0] == "False"
    assert status.phase != "Failed"


def test_run_trainer_job_failed() -> None:
    trainer = job(
        "coder-grpo-trainer",
        failed=1,
        terminating=0,
        uncountedTerminatedPods={},
        conditions=[
            {
                "type": "FailureTarget",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
                "lastProbeTime": ts(NOW),
                "lastTransitionTime": ts(NOW),
            },
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
                "lastProbeTime": ts(NOW),
                "lastTransitionTime": ts(NOW),
            },
        ],
    )
    status = _run_status(make_run(), trainer, fleet=_ready_fleet(), pool=_ready_pool())
    failed = cond(status.conditions, "Failed")
    assert (failed.status, failed.reason) == ("True", "TrainerFailed")
    assert failed.message == "trainer Job coder-grpo-trainer: Job has reached the specified backoff limit"
    assert (status.phase, status.reason) == ("Failed", "TrainerFailed")
    assert status.completion_time == STAMP
    assert reasons(status.conditions)["Training"] == ("False", "Stopped")


def test_run_fleet_leased_by_another_run() -> None:
    fleet = _ready_fleet(weights_owner="coder-grpo-v1")
    status = _run_status(make_run(), fleet=fleet, pool=_ready_pool())
    rollout = cond(status.conditions, "RolloutReady")
    assert (rollout.status, rollout.reason) == ("False", "FleetLeasedByOtherRun")
    assert "RLRun coder-grpo-v1 holds the weight lease of fleet coder-fleet" in rollout.message
    assert (status.phase, status.reason) == ("Pending", "FleetLeasedByOtherRun")
    assert reasons(status.conditions)["Training"] == ("False", "WaitingForDependencies")


def test_run_own_lease_and_evaluate_runs_share_a_leased_fleet() -> None:
    own = _run_status(make_run(), fleet=_ready_fleet(weights_owner="coder-grpo"), pool=_ready_pool())
    assert reasons(own.conditions)["RolloutReady"] == ("True", "FleetReady")
    evaluate = _run_status(
        make_run(mode="Evaluate", evaluation={"intervalSteps": 10}),
        fleet=_ready_fleet(weights_owner="coder-grpo-v1"),
        pool=_ready_pool(),
    )
    assert reasons(evaluate.conditions)["RolloutReady"] == ("True", "FleetReady")


def test_pool_with_a_task_set_the_operator_does_not_read_waits_for_the_run_controller() -> None:
    pool = make_pool(source={"taskSet": {"uri": "s3://datasets/swe-verified.jsonl"}})
    status = _pool_status(pool)
    images = cond(status.conditions, "ImagesCached")
    assert (images.status, images.reason) == ("Unknown", "TaskSetImagesUnknown")
    assert "s3://datasets/swe-verified.jsonl" in images.message
    assert status.images_desired == 0
    assert reasons(status.conditions)["Ready"] == ("True", "PoolReady")  # trials pull their own images
    # The run controller read the manifest and named its images: they are pre-pulled like listed ones.
    named = pool.model_copy(
        update={
            "metadata": pool.metadata.model_copy(
                update={"annotations": {"legorl.dev/lookahead-images": json.dumps([DJANGO, SYMPY])}}
            )
        }
    )
    assert desired_images(named, []) == [DJANGO, SYMPY]
    assert _pool_status(named).images_desired == 2


def test_pool_judges_each_prepull_pod_by_its_own_image_list() -> None:
    pool = make_pool()
    old_pod = prepull_pod(pool, "node-a", [terminated("pull-0", DJANGO)], done=True)
    old_pod["metadata"]["annotations"] = {"legorl.dev/images": json.dumps([DJANGO])}
    # The DaemonSet now asks for both images; the running pod is still the old template's.
    status = _pool_status(pool, daemon_set(pool, 0, [DJANGO, SYMPY], desired=1), old_pod)
    (node,) = status.nodes
    assert (node.desired, node.pulled) == (2, 1)
    assert reasons(status.conditions)["ImagesCached"] == ("False", "PullInProgress")
