"""Pieces every renderer shares: names, labels, owner references, hashes and pod hardening."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from legorl.api._base import GROUP_VERSION
from legorl.api.common import EnvVar, Placement, PodIdentity, ResourceRequirements
from legorl.api.kinds import Resource
from legorl.api.labels import COMPONENT_LABEL, HASH_ANNOTATION, OWNER_LABEL, PREFIX

MANAGED_BY = "legorl-operator"
"""Value of `app.kubernetes.io/managed-by` on every child; the operator watches only these."""

MAX_LABEL_VALUE = 63

STORE_MOUNT = "/store"
"""Where a `pvc://CLAIM/path` run store's claim is mounted: in the trainer's pods (read-write, the store at
`file:///store/path`) and, under Filesystem weight sync, in every engine pod of its fleet (read-only), so the
weight paths the trainer sends the engines resolve in their pods too."""


@dataclass(frozen=True)
class Images:
    """Images of legorl's own containers (chart values `operator.images.*`)."""

    proxy: str = "ghcr.io/legorl/proxy:0.1.0"
    trainer: str = "ghcr.io/legorl/trainer:0.1.0"
    sandbox_init: str = "ghcr.io/legorl/sandbox-init:0.1.0"
    harness: Mapping[str, str] = field(
        default_factory=lambda: {
            "ClaudeCode": "ghcr.io/legorl/harness-claude-code:0.1.0",
            "Codex": "ghcr.io/legorl/harness-codex:0.1.0",
            "OpenCode": "ghcr.io/legorl/harness-opencode:0.1.0",
            "OpenHands": "ghcr.io/legorl/harness-openhands:0.1.0",
            "MiniSweAgent": "ghcr.io/legorl/harness-mini-swe-agent:0.1.0",
        }
    )


@dataclass(frozen=True)
class TrialTracing:
    """Trial proxies export their spans (one per model call, parent of the engine's) to the operator's
    OTLP collector. Trial pods may reach nothing but their fleet, so this names the collector as a
    NetworkPolicy peer that the run's trial egress policy admits (the pod's egress lock lets only the
    proxy's uid out, so the agent gains nothing)."""

    endpoint: str
    """OTLP/HTTP base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`), e.g. http://otel-collector.observability:4318."""
    peer: Mapping[str, Any]
    """A NetworkPolicy peer (`namespaceSelector` / `podSelector` / `ipBlock`) that selects the collector."""
    sampler: str | None = None
    sampler_arg: str | None = None

    @property
    def port(self) -> int:
        """The collector's port, from the endpoint (default 4318, 443 for https)."""
        url = urlsplit(self.endpoint)
        return url.port or (443 if url.scheme == "https" else 4318)

    def env(self) -> list[dict[str, str]]:
        """The proxy container's `OTEL_*` variables."""
        out = [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": self.endpoint}]
        if self.sampler:
            out.append({"name": "OTEL_TRACES_SAMPLER", "value": self.sampler})
        if self.sampler_arg:
            out.append({"name": "OTEL_TRACES_SAMPLER_ARG", "value": self.sampler_arg})
        return out


@dataclass(frozen=True)
class RenderContext:
    """What rendering needs beyond the object itself; everything here is explicit input."""

    images: Images = field(default_factory=Images)
    lws_available: bool = False
    """Whether the LeaderWorkerSet API is installed (multi-node fleets use it when it is)."""
    default_store_uri: str = "pvc://legorl-store/runs"
    """Run store for runs that set no `spec.store`."""
    operator_namespace: str | None = None
    """The operator's namespace: trial pods admit its pods to their proxy port (None: the operator
    runs outside the cluster, no such rule)."""
    trial_tracing: TrialTracing | None = None
    """Where trial proxies send spans (None: they export none; the operator still emits each trial's
    stage spans from its record)."""


def short_hash(value: Any, length: int = 10) -> str:
    """A stable hex digest of a JSON-able value."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:length]


def label_value(value: str) -> str:
    """`value` if it is a valid label value, else a truncated prefix plus a hash (≤ 63 chars)."""
    if len(value) <= MAX_LABEL_VALUE:
        return value
    digest = short_hash(value, 8)
    return f"{value[: MAX_LABEL_VALUE - 9].rstrip('-._')}-{digest}"


def owner_key(kind: str, name: str) -> str:
    """The `legorl.dev/owner` label value of children of `kind`/`name`."""
    return label_value(f"{kind.lower()}.{name}")


def labels(res: Resource, component: str, app: str) -> dict[str, str]:
    """Labels of a child: the recommended `app.kubernetes.io/*` set plus `legorl.dev/*`."""
    name = res.metadata.name
    return {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": label_value(name),
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "legorl",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        OWNER_LABEL: owner_key(res.kind, name),
        COMPONENT_LABEL: component,
        f"{PREFIX}{_kind_label(res.kind)}": label_value(name),
    }


def selector_labels(res: Resource, component: str) -> dict[str, str]:
    """The immutable subset used in selectors (never add to it: selectors cannot change)."""
    return {OWNER_LABEL: owner_key(res.kind, res.metadata.name), COMPONENT_LABEL: component}


def selector_string(match_labels: Mapping[str, str]) -> str:
    """`k=v,k=v` form of a label selector (status.selector for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def _kind_label(kind: str) -> str:
    return {"RolloutFleet": "fleet", "SandboxPool": "pool", "RLRun": "run"}[kind]


def owner_reference(res: Resource) -> dict[str, Any]:
    """A controller owner reference to `res` (children are garbage-collected with it)."""
    uid = (res.metadata.model_extra or {}).get("uid")
    if not uid:
        msg = f"{res.kind} {res.metadata.name} has no metadata.uid; render children of stored objects only"
        raise ValueError(msg)
    return {
        "apiVersion": GROUP_VERSION,
        "kind": res.kind,
        "name": res.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(res: Resource, name: str, component: str, app: str, **extra: Any) -> dict[str, Any]:
    """Child metadata: name, namespace, labels, the controller owner reference."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": res.metadata.namespace or "default",
        "labels": labels(res, component, app),
        "ownerReferences": [owner_reference(res)],
    }
    meta.update(extra)
    return meta


def with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """Stamp the desired-state hash on a rendered object (computed without the stamp itself)."""
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations.pop(HASH_ANNOTATION, None)
    annotations[HASH_ANNOTATION] = short_hash(obj, 16)
    return obj


def env_list(env: list[EnvVar], base: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """core/v1 env entries: `base` literals first, then the user's (which win on name clash)."""
    out: dict[str, dict[str, Any]] = {k: {"name": k, "value": v} for k, v in (base or {}).items()}
    for var in env:
        entry: dict[str, Any] = {"name": var.name}
        if var.value_from is not None:
            ref = var.value_from.secret_key_ref
            entry["valueFrom"] = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
        else:
            entry["value"] = var.value or ""
        out[var.name] = entry
    return list(out.values())


def resources(
    req: ResourceRequirements, gpus: int = 0, gpu_resource: str = "nvidia.com/gpu"
) -> dict[str, Any]:
    """core/v1 ResourceRequirements, with `gpus` whole GPUs as both request and limit."""
    out: dict[str, Any] = {}
    requests = {k: str(v) for k, v in req.requests.items()}
    limits = {k: str(v) for k, v in req.limits.items()}
    if gpus:
        requests[gpu_resource] = str(gpus)
        limits[gpu_resource] = str(gpus)
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def pod_placement(placement: Placement, identity: PodIdentity, service_account: str | None) -> dict[str, Any]:
    """Scheduling and identity fields of a PodSpec."""
    spec: dict[str, Any] = {}
    if placement.node_selector:
        spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        spec["tolerations"] = [t.to_wire() for t in placement.tolerations]
    if placement.affinity:
        spec["affinity"] = placement.affinity
    if placement.priority_class_name:
        spec["priorityClassName"] = placement.priority_class_name
    account = identity.service_account_name or service_account
    if account:
        spec["serviceAccountName"] = account
    if identity.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in identity.image_pull_secrets]
    return spec


RESTRICTED_POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Pod-level securityContext meeting the `restricted` Pod Security Standard."""


def restricted_container(read_only_root: bool = True, user: int | None = 65532) -> dict[str, Any]:
    """Container securityContext meeting `restricted`: non-root, no privilege escalation, no caps."""
    ctx: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if user is not None:
        ctx["runAsUser"] = user
        ctx["runAsGroup"] = user
    return ctx


def service_account(res: Resource, name: str, component: str, app: str) -> dict[str, Any]:
    """A ServiceAccount with no permissions whose token is never mounted."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(res, name, component, app),
        "automountServiceAccountToken": False,
    }


def headless_service(
    res: Resource, name: str, component: str, app: str, *ports: tuple[str, int]
) -> dict[str, Any]:
    """A headless Service giving each pod of `component` a stable DNS name (rendezvous, Ray), before it
    is ready too (`publishNotReadyAddresses`: peers resolve each other while they start up).

    `ports` are (name, number) pairs: DNS needs none, they name the pods' ports (SRV records)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(res, name, component, app),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(res, component),
            "ports": [{"name": port_name, "port": number, "protocol": "TCP"} for port_name, number in ports],
        },
    }
