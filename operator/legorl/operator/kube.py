"""The operator's Kubernetes API client: the shared one (`legorl.kube`) as the operator's one identity.

Built from the credentials kopf logged in with, so the operator holds one identity, and applying as one
field manager. The handlers, reconcilers and trial pods import the client and its error from here."""

from __future__ import annotations

from legorl.kube import client
from legorl.kube.client import RESOURCES, ApiError, ApiResource
from legorl.kube.credentials import Credentials, credentials_from_kopf

__all__ = [
    "FIELD_MANAGER",
    "RESOURCES",
    "ApiError",
    "ApiResource",
    "Credentials",
    "KubeClient",
    "credentials_from_kopf",
]

FIELD_MANAGER = "legorl-operator"


class KubeClient(client.KubeClient):
    """The operator's API client (async, one connection pool, counted requests)."""

    def __init__(self, creds: Credentials, *, timeout: float = 30.0, max_connections: int = 32) -> None:
        super().__init__(
            creds,
            user_agent=FIELD_MANAGER,
            field_manager=FIELD_MANAGER,
            timeout=timeout,
            max_connections=max_connections,
        )
