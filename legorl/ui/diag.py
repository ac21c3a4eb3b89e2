"""The diagnostics page's data: `legorl.diagnostics` run over a run's store, resource, pods and events."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from legorl.api.store import RunStore

from .schemas import Diagnostics, RuleDoc, Rules

__all__ = ["diagnose_run", "rules"]

log = logging.getLogger(__name__)


def _missing(exc: ImportError) -> str:
    return f"diagnostics are not available in this build: legorl.diagnostics cannot be imported ({exc})"


def rules() -> Rules:
    """Every rule the diagnostics know (id, title, doc)."""
    try:
        from legorl.diagnostics import RULES  # noqa: PLC0415 - optional, and written alongside the UI
    except ImportError as exc:
        return Rules(available=False, note=_missing(exc), findings=[], rules=[])
    items: Iterable[Any] = RULES.values() if isinstance(RULES, Mapping) else RULES
    out = []
    for rule in items:
        out.append(
            RuleDoc(
                id=str(getattr(rule, "id", "") or ""),
                title=str(getattr(rule, "title", "") or ""),
                doc=str(getattr(rule, "doc", None) or getattr(rule, "description", "") or ""),
            )
        )
    return Rules(available=True, rules=out)


def diagnose_run(
    store: RunStore | None,
    run: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> Diagnostics:
    """Findings, worst first, as JSON; a note instead when the diagnostics cannot run."""
    try:
        from legorl.diagnostics import RunFacts, diagnose  # noqa: PLC0415
    except ImportError as exc:
        return Diagnostics(available=False, note=_missing(exc), findings=[])
    if store is None:
        return Diagnostics(
            available=False, note="diagnostics need the run store, which this UI cannot read", findings=[]
        )
    try:
        facts = RunFacts.from_store(store, run=run, pods=pods, events=events)
        findings = diagnose(facts)
    except Exception as exc:  # a failing rule must not take the page down; the error is shown
        log.exception("diagnostics failed")
        return Diagnostics(
            available=False,
            note=f"the diagnostics failed on this run: {type(exc).__name__}: {exc}",
            findings=[],
        )
    order = {"critical": 0, "warning": 1, "info": 2}
    out = [f.model_dump(mode="json") if hasattr(f, "model_dump") else dict(f) for f in findings]
    out.sort(key=lambda f: order.get(str(f.get("severity")), 3))
    return Diagnostics(available=True, findings=out)
