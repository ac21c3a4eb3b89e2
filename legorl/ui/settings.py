"""The UI's settings: one object built by the CLI (or `start_in_thread`) and passed down, never read from
the environment at import time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from legorl.kube.credentials import Credentials

__all__ = ["KubeSettings", "UiSettings"]


@dataclass(frozen=True)
class KubeSettings(Credentials):
    """How the UI reaches the Kubernetes API server (read-only, except token-gated RLRun patches)."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to read; empty: every namespace (cluster-wide list permission)."""
    timeout_seconds: float = 10.0


@dataclass(frozen=True)
class UiSettings:
    """What one UI process serves and how."""

    stores: tuple[str, ...] = ()
    """Run stores given one by one (local directories or fsspec URLs)."""
    runs_dir: str | None = None
    """A folder whose sub-folders hold run stores (`legorl run`'s `.legorl/runs`: `NAME/store`)."""
    kube: KubeSettings | None = None
    """Read RLRuns, fleets, pools, their pods and events from this cluster; None: stores only."""
    store_roots: tuple[tuple[str, str], ...] = ()
    """(URI prefix, local path) pairs that map a run's `status.storeUri` onto something this process
    can read, e.g. (`pvc://runs/`, `/mnt/runs/`) when the UI pod mounts the runs' volume."""
    action_token: str | None = field(default=None, repr=False)
    """Bearer token that unlocks actions (pause, resume, validate); None: the UI is read-only."""
    host: str = "127.0.0.1"
    port: int = 8090
    engines: tuple[tuple[str, str], ...] = ()
    """(run name, engine base URL) of engines this process knows (`legorl run` passes its vLLM), for
    the fleet view without a cluster."""
    tokenizer: Path | None = None
    """A tokenizer.json to decode token ids with; default: the newest published weights' own."""
    refresh_seconds: float = 2.0
    """How long a directory listing of a remote (non-local) store is trusted before it is listed again."""
    max_page: int = 500
    """The largest page of trials one request may ask for."""

    @property
    def actions_enabled(self) -> bool:
        return bool(self.action_token)

    def engine_url(self, run: str) -> str | None:
        for name, url in self.engines:
            if name == run:
                return url
        return None
