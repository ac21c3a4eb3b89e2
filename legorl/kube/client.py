"""The Kubernetes API client of the UI and the operator: one async httpx client per process and identity.

JSON in and out, server-side apply and merge patches, lists and gets, events; every request counted
(benchmarks report requests per object). A refusal is an `ApiError` with the server's status and message;
an unreachable server is `Unreachable` (503, transient)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from legorl.api._base import GROUP_VERSION
from legorl.api.conditions import rfc3339

from .credentials import Credentials, tls_context

__all__ = ["RESOURCES", "ApiError", "ApiResource", "KubeClient", "Unreachable"]


@dataclass(frozen=True)
class ApiResource:
    """Where a kind lives in the API."""

    group_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path; without a namespace, the list across every namespace."""
        prefix = "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"
        parts = [prefix]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{quote(namespace, safe='')}")
        parts.append(self.plural)
        if name:
            parts.append(quote(name, safe=""))
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


RESOURCES: dict[str, ApiResource] = {
    "ServiceAccount": ApiResource("v1", "serviceaccounts"),
    "Service": ApiResource("v1", "services"),
    "ConfigMap": ApiResource("v1", "configmaps"),
    "Pod": ApiResource("v1", "pods"),
    "Event": ApiResource("v1", "events"),
    "Deployment": ApiResource("apps/v1", "deployments"),
    "StatefulSet": ApiResource("apps/v1", "statefulsets"),
    "DaemonSet": ApiResource("apps/v1", "daemonsets"),
    "Job": ApiResource("batch/v1", "jobs"),
    "PodDisruptionBudget": ApiResource("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ApiResource("networking.k8s.io/v1", "networkpolicies"),
    "LeaderWorkerSet": ApiResource("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "RolloutFleet": ApiResource(GROUP_VERSION, "rolloutfleets"),
    "SandboxPool": ApiResource(GROUP_VERSION, "sandboxpools"),
    "RLRun": ApiResource(GROUP_VERSION, "rlruns"),
}
"""Every kind the operator and the UI read or write."""


class ApiError(Exception):
    """A request the API server refused; `transient` says whether retrying may help."""

    def __init__(self, status: int, message: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        return self.status in {409, 429} or self.status >= 500


class Unreachable(ApiError):
    """No answer at all (connection refused or reset, timed out): 503, retry later."""

    def __init__(self, server: str, exc: Exception, method: str, path: str) -> None:
        message = f"the Kubernetes API at {server} is unreachable ({type(exc).__name__}: {exc})"
        super().__init__(503, message, method, path)
        self.args = (f"{method} {path}: {message}",)


class KubeClient:
    """An async API client: one connection pool, one identity, one field manager, counted requests."""

    def __init__(
        self,
        creds: Credentials,
        *,
        user_agent: str,
        field_manager: str | None = None,
        timeout: float = 30.0,
        max_connections: int = 32,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Accept": "application/json", "User-Agent": user_agent}
        if creds.token:
            headers["Authorization"] = f"Bearer {creds.token}"
        self.server = creds.server
        self.field_manager = field_manager or user_agent
        self._http = httpx.AsyncClient(
            base_url=creds.server.rstrip("/"),
            headers=headers,
            verify=tls_context(creds),
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )
        self.requests: Counter[str] = Counter()

    async def close(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
        missing_ok: bool = False,
    ) -> dict[str, Any] | None:
        """The answer's JSON object; None for a 404 when `missing_ok`."""
        self.requests[method] += 1
        content = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": content_type} if content is not None else {}
        try:
            response = await self._http.request(method, path, content=content, headers=headers, params=params)
        except httpx.TransportError as exc:
            raise Unreachable(self.server, exc, method, path) from exc
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise ApiError(response.status_code, str(message)[:2000], method, path)
        if not response.content:
            return {}
        data = response.json()
        return data if isinstance(data, dict) else {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        return await self.request("GET", RESOURCES[kind].path(namespace, name), missing_ok=True)

    async def list(self, kind: str, namespace: str | None, **selectors: str) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` (every namespace when None), each with its `kind` set;
        `selectors` are `labelSelector` and `fieldSelector`."""
        data = await self.request(
            "GET", RESOURCES[kind].path(namespace), params=selectors or None, missing_ok=True
        )
        items = (data or {}).get("items") or []
        out = []
        for item in items:
            if isinstance(item, dict):
                item.setdefault("kind", kind)
                out.append(item)
        return out

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` as this client's one field manager (forcing conflicts)."""
        res = RESOURCES[obj["kind"]]
        meta = obj["metadata"]
        out = await self.request(
            "PATCH",
            res.path(meta.get("namespace"), meta["name"]),
            body=obj,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": self.field_manager, "force": "true"},
        )
        return out or {}

    async def merge_patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """A JSON merge patch of the object itself (for the few fields of objects whose other fields
        are immutable once created, such as a Job's `suspend` and `parallelism`, and the UI's actions on
        an RLRun); the patched object."""
        out = await self.request(
            "PATCH",
            RESOURCES[kind].path(namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
            params={"fieldManager": self.field_manager},
        )
        return out or {}

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object and, in the background, its dependents; absent is fine."""
        await self.request(
            "DELETE",
            RESOURCES[kind].path(namespace, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            missing_ok=True,
        )

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch `.status` through the status subresource."""
        await self.request(
            "PATCH",
            RESOURCES[kind].path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def api_available(self, group_version: str) -> bool:
        """Whether an API group/version is served (e.g. LeaderWorkerSet installed)."""
        path = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        return await self.request("GET", path, missing_ok=True) is not None

    async def event(
        self,
        involved: dict[str, Any],
        *,
        type_: str,
        reason: str,
        message: str,
        now: datetime,
    ) -> None:
        """Post a core/v1 Event about `involved` (a custom resource body), from this field manager."""
        meta = involved["metadata"]
        stamp = rfc3339(now)
        name = f"{meta['name']}.{int(now.timestamp() * 1e6):x}"
        namespace = meta.get("namespace", "default")
        event: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", GROUP_VERSION),
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": namespace,
                "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "type": type_,
            "reason": reason[:128],
            "message": message[:1024],
            "source": {"component": self.field_manager},
            "reportingComponent": self.field_manager,
            "reportingInstance": self.field_manager,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await self.request("POST", RESOURCES["Event"].path(namespace), body=event)
