"""Trainer checkpoints: sharded over the ranks, resumable at any other layout, saved atomically, pruned.

A checkpoint is a folder `<root>/step-<6 digits>/` with one `rank-<5 digits>.pt` per rank that holds
anything (torch.save of `PolicyTrainer.state()`) and `CHECKPOINT.json`, written by the writer (global rank 0)
after every rank's file is in place: the files, their sizes and sha256, the tensors each holds, the layout
it was saved at. Readers only trust folders with the JSON, so a crash mid-save leaves nothing that looks
complete. The root is any fsspec URI (a local dir in tests and the embedded default, a PVC or s3 on a
cluster).

Layout-independent: each tensor is saved as the shard it is (which whole tensor, split how, shard i of n),
once — by one data-parallel replica, every tensor-parallel shard, every pipeline stage and expert-parallel
rank its own. A rank resuming at another layout reads the files holding the tensors it needs, assembles
each whole tensor and takes its own shard of it (`PolicyTrainer.load_sharded`). Format 1 (one
`trainer.pt`, written by earlier one-rank trainers) still loads on one rank. This is megatron's
`dist_checkpointing` idea (sharded tensors with their global place) in plain torch files: that module's
optimizer support needs megatron's distributed optimizer, which needs CUDA.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
import torch

if TYPE_CHECKING:
    from legorl.trainer.train import PolicyTrainer

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step-(\d{6,})$")
FORMAT = 2
MANIFEST = "CHECKPOINT.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint."""

    step: int
    uri: str
    sha256: str
    """Digest of the checkpoint (its one file in format 1; of the files' digests in format 2)."""


@dataclass(frozen=True)
class ShardFile:
    """One rank's file of a checkpoint, as the manifest lists it."""

    name: str
    sha256: str
    bytes: int
    keys: tuple[str, ...]
    """The tensors (`ParamShard.key`) whose shards it holds."""


class CheckpointStore:
    """Trainer checkpoints under one fsspec root."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(root, **(storage_options or {}))
        self.uri = root.rstrip("/")

    def _dir(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step-{step:06d}"

    def write_shard(self, step: int, rank: int, state: Mapping[str, Any]) -> ShardFile:
        """Write rank `rank`'s part of the checkpoint of `step` (not visible until `commit`)."""
        buffer = io.BytesIO()
        torch.save(dict(state), buffer)
        payload = buffer.getvalue()
        folder = self._dir(step)
        self.fs.makedirs(folder, exist_ok=True)
        name = f"rank-{rank:05d}.pt"
        with self.fs.open(f"{folder}/{name}", "wb") as f:
            f.write(payload)
        keys = tuple(sorted(state.get("params", {})))
        return ShardFile(name, hashlib.sha256(payload).hexdigest(), len(payload), keys)

    def commit(
        self, step: int, files: Sequence[ShardFile], *, keep: int, meta: Mapping[str, Any] | None = None
    ) -> CheckpointInfo:
        """Make the checkpoint of `step` complete (its manifest), then drop all but the newest `keep`."""
        digest = hashlib.sha256("".join(f.sha256 for f in files).encode()).hexdigest()
        manifest = {
            "format": FORMAT,
            "step": step,
            "sha256": digest,
            "files": [
                {"name": f.name, "sha256": f.sha256, "bytes": f.bytes, "keys": list(f.keys)} for f in files
            ],
            "created": time.time(),
            **dict(meta or {}),
        }
        folder = self._dir(step)
        # Written beside and moved into place: a crash never leaves a half-written manifest (on object
        # stores the move is a copy of one small object, and list() skips an unreadable one anyway).
        with self.fs.open(f"{folder}/{MANIFEST}.tmp", "w") as f:
            f.write(json.dumps(manifest))
        self.fs.mv(f"{folder}/{MANIFEST}.tmp", f"{folder}/{MANIFEST}")
        for old in self.list()[:-keep]:
            self.fs.rm(self._dir(old.step), recursive=True)
        return CheckpointInfo(step=step, uri=f"{self.uri}/step-{step:06d}", sha256=digest)

    def save(self, step: int, state: Mapping[str, Any], *, keep: int) -> CheckpointInfo:
        """A one-rank checkpoint of `step`: write its file and commit it."""
        return self.commit(step, [self.write_shard(step, 0, state)], keep=keep)

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first."""
        if not self.fs.exists(self.root):
            return []
        found = []
        for entry in self.fs.ls(self.root, detail=False):
            match = _STEP_DIR.search(entry.rstrip("/"))
            if not match or not self.fs.exists(f"{entry.rstrip('/')}/{MANIFEST}"):
                continue
            try:
                with self.fs.open(f"{entry.rstrip('/')}/{MANIFEST}", "r") as f:
                    manifest = json.loads(f.read())
                digest = str(manifest["sha256"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("skipping checkpoint %s: unreadable manifest (%s)", entry, exc)
                continue
            step = int(match.group(1))
            found.append(CheckpointInfo(step=step, uri=f"{self.uri}/step-{step:06d}", sha256=digest))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        found = self.list()
        return found[-1] if found else None

    def manifest(self, step: int) -> dict[str, Any]:
        try:
            with self.fs.open(f"{self._dir(step)}/{MANIFEST}", "r") as f:
                manifest: dict[str, Any] = json.loads(f.read())
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint of step {step} under {self.uri} is incomplete: {exc}") from exc
        return manifest

    def read_file(self, step: int, name: str, sha256: str) -> dict[str, Any]:
        """One file of the checkpoint of `step`, checked against the digest its manifest gives."""
        path = f"{self._dir(step)}/{name}"
        try:
            with self.fs.open(path, "rb") as f:
                payload = f.read()
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint of step {step} under {self.uri} is incomplete: {exc}") from exc
        if hashlib.sha256(payload).hexdigest() != sha256:
            raise CheckpointError(
                f"checkpoint {path} does not match its manifest (sha256); it is damaged — "
                "delete the folder to resume from the previous checkpoint"
            )
        state: dict[str, Any] = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        return state

    def load(self, step: int, rank: int = 0) -> dict[str, Any]:
        """The state rank `rank` saved at `step` (format 1: the one `trainer.pt`), checked."""
        manifest = self.manifest(step)
        if manifest.get("format", 1) == 1:
            return self.read_file(step, "trainer.pt", str(manifest["sha256"]))
        name = f"rank-{rank:05d}.pt"
        for entry in manifest["files"]:
            if entry["name"] == name:
                return self.read_file(step, name, str(entry["sha256"]))
        raise CheckpointError(f"checkpoint of step {step} under {self.uri} has no {name}")


def save_checkpoint(
    store: CheckpointStore, step: int, trainer: PolicyTrainer, *, keep: int
) -> CheckpointInfo:
    """Every rank writes its part of the checkpoint of `step`; the writer commits it. A collective."""
    from legorl.trainer import parallel  # noqa: PLC0415

    part = store.write_shard(step, trainer.ranks.rank, trainer.state())
    parts = parallel.gather_objects(part)
    info = None
    if parts is not None:
        layout = trainer.settings.layout
        info = store.commit(
            step,
            parts,
            keep=keep,
            meta={"world": trainer.ranks.world, "layout": layout.describe()},
        )
    shared: CheckpointInfo = parallel.broadcast(info)
    return shared


def load_checkpoint(store: CheckpointStore, step: int, trainer: PolicyTrainer) -> None:
    """Restore the checkpoint of `step` into this rank, whatever layout it was saved at."""
    manifest = store.manifest(step)
    if manifest.get("format", 1) == 1:
        if trainer.ranks.world != 1:
            raise CheckpointError(
                f"checkpoint of step {step} is in the one-rank format 1; resume it on one rank, and the "
                "next checkpoint (format 2) resumes at any layout"
            )
        trainer.load_state(store.load(step))
        return
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint of step {step} has format {manifest.get('format')!r}; this reads {FORMAT}"
        )
    wanted = trainer.checkpoint_keys()
    files = [ShardFile(e["name"], e["sha256"], int(e["bytes"]), tuple(e["keys"])) for e in manifest["files"]]
    pieces: dict[str, list[dict[str, Any]]] = {key: [] for key in wanted}
    own_rng = None
    for entry in files:
        mine = (
            entry.name == f"rank-{trainer.ranks.rank:05d}.pt" and manifest.get("world") == trainer.ranks.world
        )
        if not (wanted & set(entry.keys)) and not mine:
            continue
        state = store.read_file(step, entry.name, entry.sha256)
        if mine:
            own_rng = state.get("rng")
        for key, piece in state["params"].items():
            if key in pieces:
                pieces[key].append(piece)
    missing = sorted(key for key, found in pieces.items() if not found)
    if missing:
        raise CheckpointError(
            f"checkpoint of step {step} has no shard of {missing[:4]}; it does not fit this model"
        )
    trainer.load_sharded(int(manifest["step"]), pieces, rng=own_rng)
