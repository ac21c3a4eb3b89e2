"""Everything the operator would create for a set of manifests, children of children included
(what `legorl render` prints and the golden tests pin)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from legorl.api.kinds import Resource, RLRun, RolloutFleet, SandboxPool
from legorl.api.labels import fleet_name
from legorl.operator.render.common import RenderContext
from legorl.operator.render.fleet import RenderError, render_fleet
from legorl.operator.render.pool import render_pool
from legorl.operator.render.run import WeightSyncMethod, render_run

PLACEHOLDER_UID = "00000000-0000-4000-8000-000000000000"
"""Owner UIDs are assigned by the API server; rendering outside a cluster uses this one."""
DEFAULT_PORT = 8000


def _with_identity(res: Resource, namespace: str) -> Resource:
    extra = dict(res.metadata.model_extra or {})
    extra.setdefault("uid", PLACEHOLDER_UID)
    meta = res.metadata.model_copy(update={"namespace": res.metadata.namespace or namespace})
    meta.__pydantic_extra__ = extra
    return res.model_copy(update={"metadata": meta})


def render_children(
    res: Resource, ctx: RenderContext, others: Sequence[Resource] = ()
) -> list[dict[str, Any]]:
    """The children of `res`, then (for an RLRun's own fleet and pool) their children.

    `others` are the other resources given alongside (a referenced fleet sets the port and weight sync).
    Raises `RenderError` when something cannot run on a cluster.
    """
    if isinstance(res, RolloutFleet):
        return render_fleet(res, ctx)
    if isinstance(res, SandboxPool):
        return render_pool(res, ctx, [])
    assert isinstance(res, RLRun)
    port = DEFAULT_PORT
    sync: WeightSyncMethod | None = None
    if res.spec.fleet is not None:
        port = res.spec.fleet.port
    else:
        for other in others:
            if isinstance(other, RolloutFleet) and other.metadata.name == fleet_name(res):
                port, sync = other.spec.port, other.spec.weight_sync.method
    out: list[dict[str, Any]] = []
    for child in render_run(res, ctx, port, fleet_sync=sync):
        out.append(child)
        if child["kind"] in ("RolloutFleet", "SandboxPool"):
            model = RolloutFleet if child["kind"] == "RolloutFleet" else SandboxPool
            owned = model.model_validate({**child, "metadata": {**child["metadata"], "uid": PLACEHOLDER_UID}})
            try:
                out += render_children(owned, ctx)
            except RenderError as exc:
                path = exc.path.replace("spec.model", "spec.policy.checkpoint")
                raise RenderError(path, exc.message) from exc
    return out


def render_all(
    resources: Sequence[Resource],
    ctx: RenderContext,
    namespace: str = "default",
    others: Sequence[Resource] = (),
) -> list[dict[str, Any]]:
    """Children of every resource, in order; `others` are further resources given alongside."""
    placed = [_with_identity(r, namespace) for r in resources]
    context = [*placed, *(_with_identity(r, namespace) for r in others)]
    out: list[dict[str, Any]] = []
    for res in placed:
        out += render_children(res, ctx, context)
    return out
