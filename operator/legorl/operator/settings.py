"""The operator's settings: one object per process, built from the command line and environment
once at start, then passed down (kopf memo); nothing reads the environment at import time."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from legorl.operator.render.common import Images


@dataclass(frozen=True)
class OperatorSettings:
    """How this operator process runs."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty watches the whole cluster."""
    health_port: int = 8080
    """Port of `/healthz` (kopf's liveness endpoint)."""
    metrics_port: int = 0
    """Port of `/metrics` (Prometheus text: reconciles, resources, pods, the hosted run controllers);
    0 serves none."""
    log_level: str = "INFO"
    peering: str | None = None
    """kopf peering name for several replicas (one active at a time); None runs standalone."""
    images: Images = field(default_factory=Images)
    default_store_uri: str = "pvc://legorl-store/runs"
    operator_namespace: str | None = None
    """Where the operator's own pods run (the chart's `LEGORL_OPERATOR_NAMESPACE`): each run's
    NetworkPolicy admits them to its trial pods' proxy port, the one way results leave a trial."""
    resync_seconds: float = 300.0
    """Every object is re-read from the watch cache and fully re-applied at least this often."""
    debounce_seconds: float = 0.5
    """Changes seen within this window are reconciled together."""
    settle_seconds: float = 3.0
    """After start, wait this long for every watch to list its objects before writing any status
    (a run would otherwise not yet see its fleet and call it missing, and post a Warning)."""
    concurrency: int = 16
    """Objects reconciled at once."""
    watch_timeout_seconds: int = 300
    """Server-side watch timeout (kopf re-establishes the watch after it)."""


def from_environment(base: OperatorSettings, env: Mapping[str, str] | None = None) -> OperatorSettings:
    """`base` with image and store settings from the chart's `LEGORL_*` variables."""
    env = os.environ if env is None else env
    images = replace(
        base.images,
        proxy=env.get("LEGORL_PROXY_IMAGE") or base.images.proxy,
        trainer=env.get("LEGORL_TRAINER_IMAGE") or base.images.trainer,
        sandbox_init=env.get("LEGORL_SANDBOX_INIT_IMAGE") or base.images.sandbox_init,
    )
    store = env.get("LEGORL_DEFAULT_STORE_URI") or base.default_store_uri
    namespace = env.get("LEGORL_OPERATOR_NAMESPACE") or base.operator_namespace
    return replace(base, images=images, default_store_uri=store, operator_namespace=namespace)
