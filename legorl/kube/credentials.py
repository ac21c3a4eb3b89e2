"""How to reach a Kubernetes API server: from kopf's login, the pod's ServiceAccount or a kubeconfig.

Standard library only (the kubeconfig's YAML is read when one is used), so settings objects can hold
`Credentials` without importing an HTTP client. Nothing is read at import time."""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Credentials", "credentials", "credentials_from_kopf", "tls_context"]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and who we are to it."""

    server: str
    """Base URL: the in-cluster service, a kubeconfig context's server, or `kubectl proxy`'s
    `http://127.0.0.1:8001` (which authenticates for us)."""
    token: str | None = field(default=None, repr=False)
    ca_path: str | None = None
    ca_data: bytes | None = field(default=None, repr=False)
    cert_path: str | None = None
    key_path: str | None = None
    cert_data: bytes | None = field(default=None, repr=False)
    key_data: bytes | None = field(default=None, repr=False)
    insecure: bool = False


def tls_context(creds: Credentials) -> ssl.SSLContext | bool:
    """httpx's `verify`: the cluster's CA and our client certificate (True for plain http)."""
    if not creds.server.startswith("https"):
        return True
    if creds.insecure:
        return False
    ctx = ssl.create_default_context(
        cafile=creds.ca_path, cadata=creds.ca_data.decode() if creds.ca_data else None
    )
    if creds.cert_data and creds.key_data:
        # ssl loads client keys from files only; they live only as long as the context is built.
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
            cert.write_bytes(creds.cert_data)
            key.write_bytes(creds.key_data)
            ctx.load_cert_chain(str(cert), str(key))
    elif creds.cert_path and creds.key_path:
        ctx.load_cert_chain(creds.cert_path, creds.key_path)
    return ctx


def _bytes(value: str | bytes | None) -> bytes | None:
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else value


def credentials_from_kopf(info: Any) -> Credentials:
    """Credentials from a `kopf.ConnectionInfo` (duck-typed: this module imports no kopf)."""
    return Credentials(
        server=info.server,
        token=info.token,
        ca_path=str(info.ca_path) if info.ca_path else None,
        ca_data=_bytes(info.ca_data),
        insecure=bool(info.insecure),
        cert_path=str(info.certificate_path) if info.certificate_path else None,
        key_path=str(info.private_key_path) if info.private_key_path else None,
        cert_data=_bytes(info.certificate_data),
        key_data=_bytes(info.private_key_data),
    )


def credentials(
    *,
    server: str | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Credentials:
    """`server` as given (e.g. `kubectl proxy`), else the pod's ServiceAccount, else the kubeconfig's
    (current) context. ValueError says what is missing."""
    env = dict(os.environ if environ is None else environ)
    if server:
        return Credentials(server=server)
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if host and (SA_DIR / "token").is_file() and not kubeconfig:
        ca = SA_DIR / "ca.crt"
        return Credentials(
            server=f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}",
            token=(SA_DIR / "token").read_text().strip(),
            ca_path=str(ca) if ca.is_file() else None,
        )
    return _from_kubeconfig(kubeconfig or env.get("KUBECONFIG", "").split(os.pathsep)[0], context)


def _from_kubeconfig(path_text: str | None, context: str | None) -> Credentials:
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
            f"{path}: user {ctx.get('user')!r} authenticates with a plugin legorl does not run; "
            "run `kubectl proxy` and pass --kube-server http://127.0.0.1:8001"
        )

    def data(value: Any) -> bytes | None:
        return base64.b64decode(value) if isinstance(value, str) else None

    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    return Credentials(
        server=str(cluster.get("server") or ""),
        token=token,
        ca_path=cluster.get("certificate-authority"),
        ca_data=data(cluster.get("certificate-authority-data")),
        cert_path=user.get("client-certificate"),
        key_path=user.get("client-key"),
        cert_data=data(user.get("client-certificate-data")),
        key_data=data(user.get("client-key-data")),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )
