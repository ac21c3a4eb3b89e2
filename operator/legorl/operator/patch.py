"""JSON merge patches (RFC 7386) computed from two documents: only what changed, nulls for removals."""

from __future__ import annotations

from typing import Any


def merge_patch(old: Any, new: Any) -> Any:
    """The smallest merge patch turning `old` into `new`; `{}` when they are equal.

    Objects are diffed key by key (a key missing from `new` becomes null, which deletes it);
    anything else, lists included, is replaced whole, as merge patch semantics require.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value) if isinstance(value, dict) else value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


def apply_merge_patch(doc: Any, patch: Any) -> Any:
    """Apply a merge patch (what the API server does with one)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out
