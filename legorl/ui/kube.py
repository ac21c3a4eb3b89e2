"""The UI's Kubernetes source: reads RLRuns, RolloutFleets, SandboxPools, their pods and events.

Read-only, except the token-gated actions (a merge patch of an RLRun). One async httpx client per UI
process. Credentials come from the pod's ServiceAccount, a kubeconfig, or `kubectl proxy` (which
authenticates for us); `credentials()` finds them, called by the CLI, never at import time.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from legorl.api._base import GROUP_VERSION

from .settings import KubeSettings

__all__ = ["KUBE_KINDS", "KubeError", "KubeSource", "credentials", "pod_stage"]

KUBE_KINDS: dict[str, tuple[str, str]] = {
    "RLRun": (GROUP_VERSION, "rlruns"),
    "RolloutFleet": (GROUP_VERSION, "rolloutfleets"),
    "SandboxPool": (GROUP_VERSION, "sandboxpools"),
    "Pod": ("v1", "pods"),
    "Event": ("v1", "events"),
}

# Label contract of the operator's children (legorl.operator.render): the UI may not import the
# operator (sibling layers), so the few keys it selects by are named here.
RUN_LABEL = "legorl.dev/run"
TRIAL_LABEL = "legorl.dev/trial"
OWNER_LABEL = "legorl.dev/owner"
COMPONENT_LABEL = "legorl.dev/component"
POLICY_VERSION_ANNOTATION = "legorl.dev/policy-version"

_SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(RuntimeError):
    """The API server refused or could not be reached; `status` is the HTTP status (503: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _path(kind: str, namespace: str | None, name: str | None = None) -> str:
    group_version, plural = KUBE_KINDS[kind]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    parts = [prefix]
    if namespace:
        parts.append(f"namespaces/{quote(namespace, safe='')}")
    parts.append(plural)
    if name:
        parts.append(quote(name, safe=""))
    return "/".join(parts)


def _label_match(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _tls(s: KubeSettings) -> ssl.SSLContext | bool:
    if not s.server.startswith("https"):
        return True
    if s.insecure:
        return False
    ctx = ssl.create_default_context(cafile=s.ca_path, cadata=s.ca_data.decode() if s.ca_data else None)
    if s.cert_data and s.key_data:
        with tempfile.TemporaryDirectory() as tmp:  # ssl loads client keys from files only
            cert, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
            cert.write_bytes(s.cert_data)
            key.write_bytes(s.key_data)
            ctx.load_cert_chain(str(cert), str(key))
    elif s.cert_path and s.key_path:
        ctx.load_cert_chain(s.cert_path, s.key_path)
    return ctx


class KubeSource:
    """Reads the custom resources and what they own; patches RLRuns for token-gated actions."""

    def __init__(self, settings: KubeSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        headers = {"Accept": "application/json", "User-Agent": "legorl-ui"}
        if settings.token:
            headers["Authorization"] = f"Bearer {settings.token}"
        self._http = httpx.AsyncClient(
            base_url=settings.server.rstrip("/"),
            headers=headers,
            verify=_tls(settings),
            timeout=settings.timeout_seconds,
            transport=transport,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(
        self, method: str, path: str, *, params: dict[str, str] | None = None, json: Any = None
    ) -> dict[str, Any] | None:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else None
        try:
            response = await self._http.request(method, path, params=params, json=json, headers=headers)
        except httpx.HTTPError as exc:
            raise KubeError(
                503, f"the Kubernetes API at {self.settings.server} is unreachable: {exc}"
            ) from exc
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            try:
                message = str(response.json().get("message", response.text))
            except ValueError:
                message = response.text
            raise KubeError(response.status_code, f"{method} {path}: {message[:500]}")
        data = response.json() if response.content else {}
        return data if isinstance(data, dict) else {}

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
            data = await self._request("GET", _path(kind, ns), params=selectors or None)
            items = (data or {}).get("items") or []
            for item in items:
                if isinstance(item, dict):
                    item.setdefault("kind", kind)
                    out.append(item)
        return out

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._request("GET", _path(kind, namespace, name))

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
        """A JSON merge patch of an RLRun (the spec's `suspend`, or an annotation); 404 → KubeError."""
        out = await self._request("PATCH", _path("RLRun", namespace, name), json=patch)
        if out is None:
            raise KubeError(404, f"RLRun {namespace}/{name} does not exist")
        return out


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
    """How to reach the API server: `server` as given (e.g. `kubectl proxy`), else the pod's
    ServiceAccount, else the kubeconfig's (current) context. ValueError says what is missing."""
    env = dict(os.environ if environ is None else environ)
    if server:
        return KubeSettings(server=server, namespaces=namespaces)
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if host and (_SA_DIR / "token").is_file() and not kubeconfig:
        ca = _SA_DIR / "ca.crt"
        return KubeSettings(
            server=f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}",
            token=(_SA_DIR / "token").read_text().strip(),
            ca_path=str(ca) if ca.is_file() else None,
            namespaces=namespaces,
        )
    return _from_kubeconfig(kubeconfig or env.get("KUBECONFIG", "").split(os.pathsep)[0], context, namespaces)


def _from_kubeconfig(path_text: str | None, context: str | None, namespaces: tuple[str, ...]) -> KubeSettings:
    import yaml  # noqa: PLC0415 - only when a kubeconfig is used

    path = Path(path_text) if path_text else Path.home() / ".kube" / "config"
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(
            f"no cluster credentials: not in a pod, and the kubeconfig {path} cannot be read ({exc}); "
            "pass --kubeconfig, or run `kubectl proxy` and pass --kube-server http://127.0.0.1:8001"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a kubeconfig")
    name = context or config.get("current-context")

    def find(section: str, key: str | None) -> dict[str, Any]:
        for entry in config.get(section) or []:
            if isinstance(entry, dict) and entry.get("name") == key:
                inner = entry.get(section[:-1]) or {}
                return inner if isinstance(inner, dict) else {}
        raise ValueError(f"{path}: no {section[:-1]} named {key!r}")

    ctx = find("contexts", name)
    cluster = find("clusters", ctx.get("cluster"))
    user = find("users", ctx.get("user")) if ctx.get("user") else {}
    if "exec" in user or "auth-provider" in user:
        raise ValueError(
            f"{path}: user {ctx.get('user')!r} authenticates with a plugin the UI does not run; "
            "run `kubectl proxy` and pass --kube-server http://127.0.0.1:8001"
        )

    def data(value: Any) -> bytes | None:
        return base64.b64decode(value) if isinstance(value, str) else None

    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    return KubeSettings(
        server=str(cluster.get("server") or ""),
        token=token,
        ca_path=cluster.get("certificate-authority"),
        ca_data=data(cluster.get("certificate-authority-data")),
        cert_path=user.get("client-certificate"),
        key_path=user.get("client-key"),
        cert_data=data(user.get("client-certificate-data")),
        key_data=data(user.get("client-key-data")),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        namespaces=namespaces,
    )
