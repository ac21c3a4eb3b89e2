"""The operator's settings: one object per process, built from the command line and environment
once at start, then passed down (kopf memo); nothing reads the environment at import time."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from legorl.operator.render.common import Images, TrialTracing


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
    trial_tracing: TrialTracing | None = None
    """Trial proxies' span export (`LEGORL_TRIAL_TRACING_PEER` with `OTEL_EXPORTER_OTLP_ENDPOINT`)."""
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
    engine_version_seconds: float = 15.0
    """How often the operator asks each serving engine replica which policy version it serves (`GET
    /weight_info`) and records the answer on its pod (`legorl.dev/policy-version`), which a RolloutFleet's
    `servedPolicyVersion` reports. 0: never asked (the annotation is then left to whoever loads weights)."""


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
    return replace(
        base,
        images=images,
        default_store_uri=store,
        operator_namespace=namespace,
        trial_tracing=trial_tracing(env) or base.trial_tracing,
    )


class SettingsError(ValueError):
    """A setting from the environment cannot be used (the operator exits with this message)."""


def trial_tracing(env: Mapping[str, str]) -> TrialTracing | None:
    """Trial proxies export spans when the operator has an OTLP endpoint and `LEGORL_TRIAL_TRACING_PEER`
    names the collector as a NetworkPolicy peer (JSON, e.g. `{"namespaceSelector": {"matchLabels":
    {"kubernetes.io/metadata.name": "observability"}}}`); without a peer they cannot reach it."""
    raw = env.get("LEGORL_TRIAL_TRACING_PEER", "").strip()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not raw or raw in ("{}", "null"):
        return None
    if not endpoint:
        raise SettingsError(
            "LEGORL_TRIAL_TRACING_PEER is set but OTEL_EXPORTER_OTLP_ENDPOINT is not: trial proxies need "
            "the collector's endpoint (chart: tracing.otlpEndpoint)"
        )
    try:
        peer = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"LEGORL_TRIAL_TRACING_PEER is not JSON: {exc.msg}") from None
    allowed = {"namespaceSelector", "podSelector", "ipBlock"}
    if not isinstance(peer, dict) or not peer or not set(peer) <= allowed:
        raise SettingsError(
            "LEGORL_TRIAL_TRACING_PEER must be one NetworkPolicy peer: an object with namespaceSelector, "
            f"podSelector and/or ipBlock, got {raw[:200]!r}"
        )
    return TrialTracing(
        endpoint=endpoint,
        peer=peer,
        sampler=env.get("OTEL_TRACES_SAMPLER") or None,
        sampler_arg=env.get("OTEL_TRACES_SAMPLER_ARG") or None,
    )
