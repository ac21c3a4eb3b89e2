"""The weight-publication marker: one `PUBLISHED.json` per published policy version, one type, one codec.

A published version is a Hugging Face model directory (safetensors, config, tokenizer files) with
`PUBLISHED.json` written last: the version exists once the marker does. The trainer's publisher and the run
store write it, the fleet client and the vLLM worker plugin check a directory against it, the run store, the
UI and the diagnostics list versions by it. Standard library only, so a vLLM worker can import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["MARKER_FORMAT", "PUBLISHED_MARKER", "PublishedWeights"]

PUBLISHED_MARKER: Final = "PUBLISHED.json"
"""File name of the marker inside a version's directory (`weights/v7/PUBLISHED.json` in a run store)."""
MARKER_FORMAT: Final = 1
"""Version of the marker's schema (the run store's format: markers of format 1 without `num_tensors` and
`bytes` stay readable)."""

_HEX64: Final = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PublishedWeights:
    """One published weights version, as its `PUBLISHED.json` describes it."""

    version: str
    """The policy version (`v7`); the engines report it in `/weight_info` once they serve it."""
    sha256: str
    """sha256 over the safetensors files' bytes in shard order (for one file: that file's sha256)."""
    files: tuple[str, ...]
    """The weight files, by name inside the version's directory (the safetensors shards, in order)."""
    published_at: str
    """RFC 3339 time of the publication."""
    num_tensors: int | None = None
    """Tensors in the files (None when the publisher did not count them)."""
    bytes: int | None = None
    """Total size of `files` (None when the publisher did not record it)."""
    path: str = field(default="", compare=False)
    """Where the directory was read from (a local path or a store URL); not part of the marker."""

    def to_json(self) -> dict[str, Any]:
        """The marker's JSON object (`from_json` reads it back)."""
        body: dict[str, Any] = {
            "format": MARKER_FORMAT,
            "version": self.version,
            "sha256": self.sha256,
            "files": list(self.files),
            "published_at": self.published_at,
        }
        if self.num_tensors is not None:
            body["num_tensors"] = self.num_tensors
        if self.bytes is not None:
            body["bytes"] = self.bytes
        return body

    @classmethod
    def from_json(cls, marker: Mapping[str, Any], *, path: str = "") -> PublishedWeights:
        """Read a marker object; ValueError names the first field that is missing or wrong."""
        if not isinstance(marker, Mapping):
            raise ValueError(f"a marker is a JSON object, not {type(marker).__name__}")
        if marker.get("format") != MARKER_FORMAT:
            raise ValueError(
                f"format {marker.get('format')!r} is not {MARKER_FORMAT} (written by another legorl: upgrade "
                "legorl or publish again)"
            )
        version, sha256 = marker.get("version"), marker.get("sha256")
        files, published_at = marker.get("files"), marker.get("published_at")
        num_tensors, size = marker.get("num_tensors"), marker.get("bytes")
        if not isinstance(version, str) or not version:
            raise ValueError(f"version must be a non-empty string, got {version!r}")
        if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {sha256!r}")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
            raise ValueError(f"files must be a non-empty list of file names, got {files!r}")
        if not isinstance(published_at, str):
            raise ValueError(f"published_at must be an RFC 3339 time, got {published_at!r}")
        for name, value in (("num_tensors", num_tensors), ("bytes", size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer ≥ 0, got {value!r}")
        return cls(
            version=version,
            sha256=sha256,
            files=tuple(files),
            published_at=published_at,
            num_tensors=num_tensors,
            bytes=size,
            path=path,
        )
