"""Read manifest files: multi-document YAML (or JSON), from paths or standard input."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from legorl.manifests.kubeyaml import KubeLoader, KubeYamlError, plain_texts, to_json_value


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
    """The parsed document (a dict for a valid manifest), as the API server would receive it."""
    texts: dict[tuple[str | int, ...], str] = field(default_factory=dict, compare=False)
    """Unquoted scalars Kubernetes reads as a number or a bool, by path: the text as written."""

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


class _ManifestLoader(KubeLoader):
    """YAML as kubectl reads it (`KubeLoader`: `1e-6` is a number, `2024-01-01` a string), and a
    duplicate key is an error."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                line = seen.get(key)
            except TypeError:  # an unhashable key; SafeLoader reports it below
                continue
            if line is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r} (first at line {line})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _is_acyclic(obj: Any, path: tuple[int, ...] = ()) -> bool:
    if isinstance(obj, (dict, list)):
        if id(obj) in path:
            return False
        children = obj.values() if isinstance(obj, dict) else obj
        return all(_is_acyclic(child, (*path, id(obj))) for child in children)
    return True


def parse_documents(text: str, source: str) -> list[Document]:
    """Split and parse YAML documents, skipping empty ones."""
    docs: list[Document] = []
    loader = _ManifestLoader(text)
    try:
        index = 0
        while loader.check_node():
            node = loader.get_node()
            if node is None:  # check_node() said there is one; only the stubs say otherwise
                break
            body = loader.construct_document(node)
            if not _is_acyclic(body):
                raise ManifestLoadError(
                    f"{source}:{node.start_mark.line + 1}: a YAML alias refers to itself; "
                    "manifests cannot be recursive"
                )
            if body is not None:
                line = node.start_mark.line + 1
                try:
                    body = to_json_value(body)
                except KubeYamlError as exc:
                    raise ManifestLoadError(f"{source}:{line}: {exc}") from exc
                docs.append(Document(source, index, line, body, plain_texts(node)))
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
