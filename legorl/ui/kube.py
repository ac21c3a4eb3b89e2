"""The UI's Kubernetes source: reads RLRuns, RolloutFleets, SandboxPools, their pods and events.

Read-only, except the token-gated actions (a merge patch of an RLRun), over the shared API client
(`legorl.kube`), one per UI process. Credentials come from the pod's ServiceAccount, a kubeconfig, or
`kubectl proxy` (which authenticates for us); `credentials()` finds them, called by the CLI, never at
import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import httpx

from legorl.api.labels import COMPONENT_LABEL
from legorl.kube import credentials as shared
from legorl.kube.client import ApiError, KubeClient

from .settings import KubeSettings

__all__ = ["ApiError", "KubeSource", "credentials", "pod_stage"]

# Label contract of the operator's children (legorl.operator.render): the UI may not import the
# operator (sibling layers), so the few keys it selects by are named here.


def _label_match(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


class KubeSource:
    """Reads the custom resources and what they own; patches RLRuns for token-gated actions."""

    def __init__(self, settings: KubeSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.client = KubeClient(
            settings, user_agent="legorl-ui", timeout=settings.timeout_seconds, transport=transport
        )

    async def close(self) -> None:
        await self.client.close()

    async def list_objects(
        self, kind: str, namespace: str | None = None, **selectors: str
    ) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` (every watched namespace when None), newest API state.

        Label and field selectors are sent and also applied here (some API mocks ignore them)."""
        namespaces: tuple[str | None, ...] = (
            (namespace,) if namespace else (self.settings.namespaces or (None,))
        )
        out: list[dict[str, Any]] = []
        for ns in namespaces:
            out += await self.client.list(kind, ns, **selectors)
        return out

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.client.get(kind, namespace, name)

    async def pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        items = await self.list_objects("Pod", namespace, labelSelector=selector)
        return [p for p in items if _label_match(p, labels)]

    async def events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        items = await self.list_objects("Event", namespace, fieldSelector=selector)
        return [
            e
            for e in items
            if (e.get("involvedObject") or {}).get("name") == name
            and (e.get("involvedObject") or {}).get("kind") == kind
        ]

    async def patch_run(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of an RLRun (the spec's `suspend`, or an annotation); 404 → ApiError."""
        return await self.client.merge_patch("RLRun", namespace, name, patch)


def pod_stage(pod: Mapping[str, Any]) -> str:
    """Where a trial-side pod is: scheduling, setup, agent, verify, done or failed."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase == "Succeeded":
        return "done"
    if phase == "Failed":
        return "failed"
    if labels.get(COMPONENT_LABEL) == "verify":
        return "verify"
    if phase == "Pending":
        init = status.get("initContainerStatuses") or []
        if any((c.get("state") or {}).get("running") for c in init):
            return "setup"
        if not status.get("startTime") or not any(
            c.get("type") == "PodScheduled" and c.get("status") == "True"
            for c in status.get("conditions") or []
        ):
            return "scheduling"
        return "setup"
    return "agent"


def credentials(
    *,
    server: str | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
    namespaces: tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> KubeSettings:
    """How to reach the API server (`legorl.kube.credentials.credentials`), and which namespaces to read.
    ValueError says what is missing."""
    found = shared.credentials(server=server, kubeconfig=kubeconfig, context=context, environ=environ)
    fields = {f.name: getattr(found, f.name) for f in dataclasses.fields(found)}
    return KubeSettings(**fields, namespaces=namespaces)
