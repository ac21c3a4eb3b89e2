"""Compact, pure views of observed child objects: what status computation and diffing need,
small enough to keep in kopf indexes for every child the operator manages."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from legorl.api.labels import (
    HASH_ANNOTATION,
    IMAGES_ANNOTATION,
    OWNER_LABEL,
    POLICY_VERSION_ANNOTATION,
    PREFIX,
)

MAX_VERSION = 63
PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
CRASH_REASONS = frozenset({"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError"})


@dataclass(frozen=True)
class ContainerState:
    """One (init) container of a pod: name, image and where it stands."""

    name: str
    image: str
    state: str
    """`done` (init container exited 0), `running`, `waiting`, `failed` (exited non-zero)."""
    reason: str = ""
    message: str = ""
    restarts: int = 0
    ready: bool = False


@dataclass(frozen=True)
class PodView:
    """What the operator needs from a pod."""

    name: str
    node: str
    ip: str
    phase: str
    ready: bool
    deleting: bool
    labels: Mapping[str, str]
    policy_version: str | None
    unschedulable: str | None
    """The scheduler's message when the pod cannot be placed."""
    containers: tuple[ContainerState, ...] = ()
    init_containers: tuple[ContainerState, ...] = ()
    images: tuple[str, ...] | None = None
    """A pre-pull pod's own image list (its `legorl.dev/images` annotation), if it has one."""


@dataclass(frozen=True)
class ChildView:
    """Any managed child: identity, the desired-state hash it was applied with, and for
    workloads the counters their controllers report."""

    kind: str
    name: str
    hash: str | None
    generation: int = 0
    observed_generation: int = 0
    counters: Mapping[str, int] = field(default_factory=dict)
    conditions: Mapping[str, tuple[str, str, str]] = field(default_factory=dict)
    """type → (status, reason, message)."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Its `legorl.dev/*` annotations (a pre-pull DaemonSet's `legorl.dev/images`)."""


def owner_of(body: Mapping[str, Any]) -> str | None:
    """The `legorl.dev/owner` label of a child (None for objects that are not ours)."""
    labels = body.get("metadata", {}).get("labels") or {}
    value = labels.get(OWNER_LABEL)
    return value if isinstance(value, str) else None


def _container_state(status: Mapping[str, Any], init: bool) -> ContainerState:
    state = status.get("state") or {}
    name, image = status.get("name", ""), status.get("image", "")
    restarts = int(status.get("restartCount", 0))
    ready = bool(status.get("ready", False))
    if "terminated" in state:
        term = state["terminated"]
        code = int(term.get("exitCode", 0))
        kind = "done" if code == 0 else "failed"
        return ContainerState(
            name, image, kind, term.get("reason", ""), term.get("message", ""), restarts, ready
        )
    if "waiting" in state:
        wait = state["waiting"]
        reason = wait.get("reason", "")
        last = (status.get("lastState") or {}).get("terminated") or {}
        # The kubelet always explains a back-off ("back-off 5m0s restarting failed container=…"),
        # so the last exit (OOMKilled, Error) is added to that message, not only used without one.
        last_exit = f"last exit: {last.get('reason', '')} ({last.get('exitCode')})" if last else ""
        if last.get("message"):
            last_exit += f": {str(last['message']).strip()}"
        message = "; ".join(m for m in (last_exit, wait.get("message", "")) if m)
        return ContainerState(name, image, "waiting", reason, message, restarts, ready)
    if "running" in state:
        return ContainerState(name, image, "running", "", "", restarts, ready)
    return ContainerState(name, image, "waiting", "", "", restarts, ready)


def _policy_version(value: object) -> str | None:
    """The annotation's version if it fits the status fields (≤ 63 characters), else None."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_VERSION else None


def pod_view(body: Mapping[str, Any]) -> PodView:
    meta, status = body.get("metadata", {}), body.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = (
        scheduled.get("message") or "Unschedulable"
        if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
        else None
    )
    return PodView(
        name=meta.get("name", ""),
        node=(body.get("spec") or {}).get("nodeName", ""),
        ip=status.get("podIP", ""),
        phase=status.get("phase", "Pending"),
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
        labels=dict(meta.get("labels") or {}),
        policy_version=_policy_version((meta.get("annotations") or {}).get(POLICY_VERSION_ANNOTATION)),
        unschedulable=unschedulable,
        containers=tuple(_container_state(s, False) for s in status.get("containerStatuses") or []),
        init_containers=tuple(_container_state(s, True) for s in status.get("initContainerStatuses") or []),
        images=_image_list((meta.get("annotations") or {}).get(IMAGES_ANNOTATION)),
    )


def _image_list(raw: object) -> tuple[str, ...] | None:
    if not isinstance(raw, str):
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else None


_COUNTERS = (
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "availableReplicas",
    "desiredNumberScheduled",
    "currentNumberScheduled",
    "numberReady",
    "updatedNumberScheduled",
    "numberAvailable",
    "active",
    "succeeded",
    "failed",
    "ready",
)


def child_view(body: Mapping[str, Any]) -> ChildView:
    meta, status = body.get("metadata", {}), body.get("status") or {}
    kind = body.get("kind", "")
    spec = body.get("spec") or {}
    counters = {k: int(status[k]) for k in _COUNTERS if isinstance(status.get(k), int)}
    if "replicas" in spec and isinstance(spec["replicas"], int):
        counters["specReplicas"] = spec["replicas"]
    conditions = {
        c["type"]: (c.get("status", "Unknown"), c.get("reason", ""), c.get("message", ""))
        for c in status.get("conditions") or []
        if isinstance(c, dict) and "type" in c
    }
    annotations = meta.get("annotations") or {}
    return ChildView(
        kind=kind,
        name=meta.get("name", ""),
        hash=annotations.get(HASH_ANNOTATION),
        generation=int(meta.get("generation", 0) or 0),
        observed_generation=int(status.get("observedGeneration", 0) or 0),
        counters=counters,
        conditions=conditions,
        annotations={k: v for k, v in annotations.items() if k.startswith(PREFIX)},
    )


@dataclass
class Observed:
    """Everything observed about one custom resource's children."""

    children: dict[tuple[str, str], ChildView] = field(default_factory=dict)
    """(kind, name) → view."""
    pods: list[PodView] = field(default_factory=list)

    def child(self, kind: str, name: str) -> ChildView | None:
        return self.children.get((kind, name))

    def of_kind(self, kind: str) -> list[ChildView]:
        return sorted((v for (k, _), v in self.children.items() if k == kind), key=lambda v: v.name)
