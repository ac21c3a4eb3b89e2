"""A problem found in a manifest, and how it is told to a person: one line, field path, fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from legorl.api.kinds import Resource
from legorl.manifests.load import Document

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One problem with one manifest document."""

    severity: Severity
    path: str
    """Field path from the document root, e.g. `spec.algorithm.groupSize`."""
    message: str
    """What is wrong and how to fix it."""
    check: str = "schema"
    """Which stage found it: `schema`, `cel`, `preflight`, `load`."""

    def format(self, where: str) -> str:
        """One line: `where: severity: path: message`."""
        location = f"{self.path}: " if self.path else ""
        return f"{where}: {self.severity}: {location}{self.message}"


@dataclass
class DocumentReport:
    """Validation result of one document."""

    document: Document
    problems: list[Problem] = field(default_factory=list)
    resource: Resource | None = None
    """The parsed resource, when the schema stage passed."""
    body: dict[str, Any] | None = None
    """The document as validated: status dropped, explicit nulls pruned."""

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)
