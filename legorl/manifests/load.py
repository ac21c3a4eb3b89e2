"""Read manifest files: multi-document YAML (or JSON), from paths or standard input."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Document:
    """One YAML document of a manifest file."""

    source: str
    """File name (or `-` for standard input)."""
    index: int
    """Position of the document in its file, from 0."""
    line: int
    """Line the document starts on, from 1."""
    body: Any
    """The parsed document (a dict for a valid manifest)."""

    @property
    def label(self) -> str:
        """`file:line (Kind/name)` for messages."""
        where = f"{self.source}:{self.line}"
        if isinstance(self.body, dict):
            kind = self.body.get("kind", "?")
            meta = self.body.get("metadata")
            name = meta.get("name", "?") if isinstance(meta, dict) else "?"
            return f"{where} ({kind}/{name})"
        return where


class ManifestLoadError(ValueError):
    """A file could not be read or is not valid YAML."""


def _read(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestLoadError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ManifestLoadError(f"{source}: not UTF-8 text: {exc.reason}") from exc


def parse_documents(text: str, source: str) -> list[Document]:
    """Split and parse YAML documents, skipping empty ones."""
    docs: list[Document] = []
    loader = yaml.SafeLoader(text)
    try:
        index = 0
        while loader.check_node():
            node = loader.get_node()
            body = loader.construct_document(node) if node is not None else None
            if node is not None and body is not None:
                docs.append(Document(source, index, node.start_mark.line + 1, body))
            index += 1
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestLoadError(f"{where}: invalid YAML: {problem}") from exc
    finally:
        loader.dispose()
    return docs


def load_documents(source: str) -> list[Document]:
    """Read and parse one file (`-` reads standard input)."""
    return parse_documents(_read(source), source)
