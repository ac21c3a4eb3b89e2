"""Trainer checkpoints: model, optimizer, step and RNG state, saved atomically and pruned to the newest N.

A checkpoint is one `trainer.pt` (torch.save of `PolicyTrainer.state()`) plus `CHECKPOINT.json` written
after it, under `<root>/step-<6 digits>/`. Readers only trust folders with the JSON, so a crash mid-save
leaves nothing that looks complete. The root is any fsspec URI (a local dir in tests and the embedded
default, a PVC or s3 on a cluster).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint."""

    step: int
    uri: str
    sha256: str


class CheckpointStore:
    """Trainer checkpoints under one fsspec root."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(root, **(storage_options or {}))
        self.uri = root.rstrip("/")

    def _dir(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step-{step:06d}"

    def save(self, step: int, state: dict[str, Any], *, keep: int) -> CheckpointInfo:
        """Write the checkpoint of `step`, then drop all but the newest `keep` complete ones."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        digest = hashlib.sha256(payload).hexdigest()
        folder = self._dir(step)
        self.fs.makedirs(folder, exist_ok=True)
        with self.fs.open(f"{folder}/trainer.pt", "wb") as f:
            f.write(payload)
        manifest = {"step": step, "sha256": digest, "bytes": len(payload), "created": time.time()}
        # Written beside and moved into place: a crash never leaves a half-written manifest (on object
        # stores the move is a copy of one small object, and list() skips an unreadable one anyway).
        with self.fs.open(f"{folder}/CHECKPOINT.json.tmp", "w") as f:
            f.write(json.dumps(manifest))
        self.fs.mv(f"{folder}/CHECKPOINT.json.tmp", f"{folder}/CHECKPOINT.json")
        for old in self.list()[:-keep]:
            self.fs.rm(self._dir(old.step), recursive=True)
        return CheckpointInfo(step=step, uri=f"{self.uri}/step-{step:06d}", sha256=digest)

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first."""
        if not self.fs.exists(self.root):
            return []
        found = []
        for entry in self.fs.ls(self.root, detail=False):
            match = _STEP_DIR.search(entry.rstrip("/"))
            if not match or not self.fs.exists(f"{entry.rstrip('/')}/CHECKPOINT.json"):
                continue
            try:
                with self.fs.open(f"{entry.rstrip('/')}/CHECKPOINT.json", "r") as f:
                    manifest = json.loads(f.read())
            except (OSError, ValueError) as exc:
                log.warning("skipping checkpoint %s: unreadable manifest (%s)", entry, exc)
                continue
            step = int(match.group(1))
            found.append(
                CheckpointInfo(step=step, uri=f"{self.uri}/step-{step:06d}", sha256=manifest["sha256"])
            )
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        found = self.list()
        return found[-1] if found else None

    def load(self, step: int) -> dict[str, Any]:
        """The state saved at `step`, checked against its manifest."""
        folder = self._dir(step)
        try:
            with self.fs.open(f"{folder}/CHECKPOINT.json", "r") as f:
                manifest = json.loads(f.read())
            with self.fs.open(f"{folder}/trainer.pt", "rb") as f:
                payload = f.read()
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint of step {step} under {self.uri} is incomplete: {exc}") from exc
        if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
            raise CheckpointError(
                f"checkpoint {folder}/trainer.pt does not match its manifest (sha256); it is damaged — "
                "delete the folder to resume from the previous checkpoint"
            )
        state: dict[str, Any] = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        return state
