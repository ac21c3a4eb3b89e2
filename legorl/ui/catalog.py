"""Which runs the UI shows: run stores given on the command line or found in a runs folder, and RLRuns
read from a cluster (each with its run store when this process can read it)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.api.lenient import status_of
from legorl.api.run import RLRunStatus
from legorl.api.store import StoreLayout

from .data import NotFound, StoreData
from .kube import ApiError, KubeSource
from .settings import UiSettings

__all__ = ["Catalog", "RunEntry"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class RunEntry:
    """One run as the UI knows it."""

    id: str
    """URL-safe key: the run's name for a local store, `<namespace>~<name>` for an RLRun."""
    name: str
    namespace: str | None = None
    store: StoreData | None = None
    resource: dict[str, Any] | None = None
    """The RLRun as the API server holds it (cluster runs only)."""
    status: RLRunStatus = field(default_factory=RLRunStatus)
    """The RLRun's status, typed (`legorl.api.lenient.status_of`; the defaults for a local run store)."""
    store_note: str | None = None
    """Why the run store cannot be read, when it cannot."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return "cluster" if self.resource is not None else "store"


def _slug(name: str) -> str:
    return _UNSAFE.sub("-", name).strip("-.") or "run"


class Catalog:
    """Finds runs; keeps one `StoreData` (and its caches) per run store for the process's lifetime."""

    def __init__(self, settings: UiSettings, kube: KubeSource | None = None) -> None:
        self.settings = settings
        self.kube = kube
        self._stores: dict[str, StoreData] = {}

    def store(self, uri: str) -> StoreData:
        data = self._stores.get(uri)
        if data is None:
            data = StoreData(
                uri, refresh_seconds=self.settings.refresh_seconds, tokenizer=self.settings.tokenizer
            )
            self._stores[uri] = data
        return data

    # --- local stores ----------------------------------------------------------------------------
    def _store_uris(self) -> list[str]:
        uris = list(self.settings.stores)
        if self.settings.runs_dir:
            root = Path(self.settings.runs_dir)
            children = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
            for child in children:
                for candidate in (child / "store", child):
                    if (candidate / StoreLayout.RUN).is_file() or (
                        candidate / StoreLayout.CONTROLLER_STATE
                    ).parent.is_dir():
                        uris.append(str(candidate))
                        break
        return uris

    def local_runs(self) -> list[RunEntry]:
        entries: list[RunEntry] = []
        taken: set[str] = set()
        for uri in self._store_uris():
            data = self.store(uri)
            name = data.name()
            key = _slug(name)
            n = 2
            while key in taken:
                key = f"{_slug(name)}-{n}"
                n += 1
            taken.add(key)
            entries.append(RunEntry(id=key, name=name, store=data))
        return entries

    # --- cluster runs -----------------------------------------------------------------------------
    def resolve_store_uri(self, uri: str | None) -> tuple[str | None, str | None]:
        """(a URI this process can open, None) or (None, why not)."""
        if not uri:
            return None, "the run reports no store yet (status.storeUri)"
        for prefix, local in self.settings.store_roots:
            if uri.startswith(prefix):
                path = local.rstrip("/") + "/" + uri[len(prefix) :].lstrip("/")
                if Path(path).is_dir():
                    return path, None
                return None, f"{uri} maps to {path}, which this UI pod does not have (yet)"
        scheme, _, rest = uri.partition("://")
        if scheme == "file":
            return (rest, None) if Path(rest).is_dir() else (None, f"{rest} is not a folder here")
        if scheme == "pvc":
            return None, (
                f"{uri} is on a PersistentVolumeClaim this UI does not mount; mount it and pass "
                "--pvc-root, or use an s3:// / gs:// store"
            )
        if scheme in ("s3", "gs", "gcs", "az", "abfs", "memory"):
            return uri, None
        return None, f"unsupported store URI {uri!r}"

    def _cluster_entry(self, body: dict[str, Any]) -> RunEntry:
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        status = status_of(RLRunStatus, body)
        uri, note = self.resolve_store_uri(status.store_uri)
        store = None
        if uri is not None:
            try:
                store = self.store(uri)
            except (ValueError, RuntimeError) as exc:  # StoreError: a filesystem that is not installed
                note = str(exc)
        return RunEntry(
            id=f"{namespace}~{name}",
            name=name,
            namespace=namespace,
            store=store,
            resource=body,
            status=status,
            store_note=note,
        )

    async def runs(self) -> tuple[list[RunEntry], str | None]:
        """Every run, and a note when the cluster could not be read."""
        entries = await asyncio.to_thread(self.local_runs)
        note = None
        if self.kube is not None:
            try:
                bodies = await self.kube.list_objects("RLRun")
            except ApiError as exc:
                note = str(exc)
                bodies = []
            cluster = await asyncio.to_thread(lambda: [self._cluster_entry(b) for b in bodies])
            entries = sorted(cluster, key=lambda e: e.id) + entries
        return entries, note

    async def get(self, run_id: str) -> RunEntry:
        if "~" in run_id and self.kube is not None:
            namespace, _, name = run_id.partition("~")
            body = await self.kube.get("RLRun", namespace, name)
            if body is None:
                raise NotFound(f"no RLRun {name!r} in namespace {namespace!r}")
            return await asyncio.to_thread(self._cluster_entry, body)
        for entry in await asyncio.to_thread(self.local_runs):
            if entry.id == run_id:
                return entry
        raise NotFound(f"no run {run_id!r}; GET api/runs lists the runs this UI knows")
