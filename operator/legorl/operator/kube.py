"""The operator's Kubernetes API I/O: server-side apply, delete, status patches, events.

One small async client over httpx, built from the credentials kopf logged in with,
so the operator holds one identity. Every request is counted (benchmarks report
requests per object).
"""

from __future__ import annotations

import json
import ssl
import tempfile
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from legorl.api._base import GROUP_VERSION
from legorl.api.conditions import rfc3339

FIELD_MANAGER = "legorl-operator"


@dataclass(frozen=True)
class ApiResource:
    """Where a kind lives in the API."""

    group_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        prefix = "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"
        parts = [prefix]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{quote(namespace)}")
        parts.append(self.plural)
        if name:
            parts.append(quote(name))
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
"""Every kind the operator reads or writes."""


class ApiError(Exception):
    """A request the API server refused; `transient` says whether retrying may help."""

    def __init__(self, status: int, message: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        return self.status in {409, 429} or self.status >= 500


@dataclass(frozen=True)
class Credentials:
    """How to reach the API server (from kopf's login, or given directly in tests)."""

    server: str
    token: str | None = None
    ca_path: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    cert_path: str | None = None
    key_path: str | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None


def _data(value: str | bytes | None) -> bytes | None:
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else value


def credentials_from_kopf(info: Any) -> Credentials:
    """Credentials from a `kopf.ConnectionInfo` (duck-typed: this module imports no kopf)."""
    return Credentials(
        server=info.server,
        token=info.token,
        ca_path=str(info.ca_path) if info.ca_path else None,
        ca_data=_data(info.ca_data),
        insecure=bool(info.insecure),
        cert_path=str(info.certificate_path) if info.certificate_path else None,
        key_path=str(info.private_key_path) if info.private_key_path else None,
        cert_data=_data(info.certificate_data),
        key_data=_data(info.private_key_data),
    )


def _tls(creds: Credentials) -> ssl.SSLContext | bool:
    if not creds.server.startswith("https"):
        return True
    if creds.insecure:
        return False
    ctx = ssl.create_default_context(
        cafile=creds.ca_path, cadata=creds.ca_data.decode() if creds.ca_data else None
    )
    cert, key = creds.cert_path, creds.key_path
    if creds.cert_data and creds.key_data:
        # ssl wants files; they live only as long as the context is built.
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "tls.crt").write_bytes(creds.cert_data)
            Path(tmp, "tls.key").write_bytes(creds.key_data)
            ctx.load_cert_chain(str(Path(tmp, "tls.crt")), str(Path(tmp, "tls.key")))
    elif cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


class KubeClient:
    """The operator's API client (async, one connection pool, counted requests)."""

    def __init__(self, creds: Credentials, *, timeout: float = 30.0, max_connections: int = 32) -> None:
        headers = {"Accept": "application/json", "User-Agent": "legorl-operator"}
        if creds.token:
            headers["Authorization"] = f"Bearer {creds.token}"
        self._http = httpx.AsyncClient(
            base_url=creds.server.rstrip("/"),
            headers=headers,
            verify=_tls(creds),
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self.requests: Counter[str] = Counter()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
        missing_ok: bool = False,
    ) -> dict[str, Any] | None:
        self.requests[method] += 1
        content = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": content_type} if content is not None else {}
        try:
            response = await self._http.request(method, path, content=content, headers=headers, params=params)
        except httpx.TransportError as exc:  # connection refused, reset, timed out: retry later
            raise ApiError(503, f"{type(exc).__name__}: {exc}", method, path) from exc
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

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` as the operator's one field manager (forcing conflicts)."""
        res = RESOURCES[obj["kind"]]
        meta = obj["metadata"]
        out = await self._send(
            "PATCH",
            res.path(meta.get("namespace"), meta["name"]),
            body=obj,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
        )
        return out or {}

    async def merge_patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """A JSON merge patch of the object itself (for the few fields of objects whose other fields
        are immutable once created, such as a Job's `suspend` and `parallelism`); the patched object."""
        out = await self._send(
            "PATCH",
            RESOURCES[kind].path(namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
            params={"fieldManager": FIELD_MANAGER},
        )
        return out or {}

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object and, in the background, its dependents; absent is fine."""
        await self._send(
            "DELETE",
            RESOURCES[kind].path(namespace, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            missing_ok=True,
        )

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._send("GET", RESOURCES[kind].path(namespace, name), missing_ok=True)

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch `.status` through the status subresource."""
        await self._send(
            "PATCH",
            RESOURCES[kind].path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def api_available(self, group_version: str) -> bool:
        """Whether an API group/version is served (e.g. LeaderWorkerSet installed)."""
        path = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        return await self._send("GET", path, missing_ok=True) is not None

    async def event(
        self,
        involved: dict[str, Any],
        *,
        type_: str,
        reason: str,
        message: str,
        now: datetime,
    ) -> None:
        """Post a core/v1 Event about `involved` (a custom resource body)."""
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
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": FIELD_MANAGER,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await self._send("POST", RESOURCES["Event"].path(namespace), body=event)
