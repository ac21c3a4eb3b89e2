"""The operator's in-memory picture of the cluster, fed by kopf's watch streams.

Child objects are kept as compact views keyed by their owner; custom resources
are kept whole. Reconciles read from here instead of listing the API server, and
every change marks its owner dirty so status follows actual state promptly.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from legorl.operator.observe import ChildView, Observed, PodView, child_view, owner_of, pod_view

CUSTOM_KINDS = ("RolloutFleet", "SandboxPool", "RLRun")
ObjectKey = tuple[str, str, str]
"""(kind, namespace, name) of a custom resource."""


def owner_object(namespace: str, owner: str) -> ObjectKey | None:
    """The custom resource named by a `legorl.dev/owner` label value."""
    kind, _, name = owner.partition(".")
    for candidate in CUSTOM_KINDS:
        if candidate.lower() == kind and name:
            return candidate, namespace, name
    return None


@dataclass
class Store:
    """Observed children by owner, custom resources by key, and the dirty set."""

    children: dict[tuple[str, str], dict[tuple[str, str], ChildView]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    pods: dict[tuple[str, str], dict[str, PodView]] = field(default_factory=lambda: defaultdict(dict))
    objects: dict[ObjectKey, dict[str, Any]] = field(default_factory=dict)
    dependents: dict[ObjectKey, set[ObjectKey]] = field(default_factory=lambda: defaultdict(set))
    """A fleet or pool → the runs that use it (their status follows its status)."""
    uses: dict[ObjectKey, tuple[ObjectKey, ...]] = field(default_factory=dict)
    """A run → the fleet and pool it uses (the reverse of `dependents`)."""
    dirty: set[ObjectKey] = field(default_factory=set)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def mark(self, key: ObjectKey) -> None:
        self.dirty.add(key)
        self.wakeup.set()

    def mark_all(self) -> None:
        for key in self.objects:
            self.dirty.add(key)
        self.wakeup.set()

    def take_dirty(self) -> list[ObjectKey]:
        keys = sorted(self.dirty)
        self.dirty.clear()
        self.wakeup.clear()
        return keys

    # --- feeding from watch events ------------------------------------------------------
    def child_event(self, namespace: str, body: Mapping[str, Any], deleted: bool) -> None:
        """A watch event of a managed child (any kind but Pod)."""
        owner = owner_of(body)
        if owner is None:
            return
        key = (body.get("kind", ""), body.get("metadata", {}).get("name", ""))
        bucket = self.children[(namespace, owner)]
        if deleted:
            bucket.pop(key, None)
        else:
            bucket[key] = child_view(body)
        self._mark_owner(namespace, owner)

    def pod_event(self, namespace: str, body: Mapping[str, Any], deleted: bool) -> None:
        owner = owner_of(body)
        if owner is None:
            return
        name = body.get("metadata", {}).get("name", "")
        bucket = self.pods[(namespace, owner)]
        if deleted:
            bucket.pop(name, None)
        else:
            bucket[name] = pod_view(body)
        self._mark_owner(namespace, owner)

    def object_event(self, kind: str, namespace: str, body: Mapping[str, Any], deleted: bool) -> None:
        """A watch event of one of our custom resources."""
        key = (kind, namespace, body.get("metadata", {}).get("name", ""))
        if deleted:
            self.objects.pop(key, None)
            self.dirty.discard(key)
            self.set_dependencies(key, ())  # a deleted run no longer follows anything
        else:
            self.objects[key] = dict(body)
            self.mark(key)
        for dependent in self.dependents.get(key, ()):
            self.mark(dependent)
        # An owned fleet or pool is also a child of its run.
        if owner_of(body) is not None:
            self.child_event(namespace, body, deleted)

    def _mark_owner(self, namespace: str, owner: str) -> None:
        key = owner_object(namespace, owner)
        if key is not None and key in self.objects:
            self.mark(key)

    # --- reading --------------------------------------------------------------------------
    def observed(self, namespace: str, owner: str) -> Observed:
        return Observed(
            children=dict(self.children.get((namespace, owner), {})),
            pods=list(self.pods.get((namespace, owner), {}).values()),
        )

    def set_dependencies(self, run: ObjectKey, uses: Iterable[ObjectKey]) -> None:
        for key in self.uses.get(run, ()):
            self.dependents[key].discard(run)
        self.uses[run] = tuple(uses)
        for key in self.uses[run]:
            self.dependents[key].add(run)
