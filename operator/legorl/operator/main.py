"""Run the operator: kopf settings, peering or standalone, namespaces, the liveness endpoint, and the
observability the handlers pick up from kopf's memo (metrics, the trial traces' provider)."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from typing import Any

import kopf

from legorl.api.labels import FINALIZER
from legorl.operator.handlers import LoginFn, build_registry
from legorl.operator.metrics import MeteredReconciler
from legorl.operator.reconcile import Reconciler
from legorl.operator.render.common import RenderContext
from legorl.operator.settings import OperatorSettings


def kopf_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    """kopf's own settings: bookkeeping in `legorl.dev/` annotations, never in `.status`."""
    config = kopf.OperatorSettings()
    config.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="legorl.dev")
    config.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="legorl.dev", key="last-handled-configuration"
    )
    config.persistence.finalizer = FINALIZER
    # Our own Events say what changed; kopf posts only its warnings and errors.
    config.posting.level = logging.WARNING
    config.watching.server_timeout = settings.watch_timeout_seconds
    config.watching.client_timeout = settings.watch_timeout_seconds + 60
    if settings.peering is not None:
        config.peering.name = settings.peering
        config.peering.mandatory = True
        config.peering.clusterwide = not settings.namespaces
        # Each replica its own priority: kopf freezes every replica whose peers have the same one ("Possibly
        # conflicting operators with the same priority"), so with the default, 0 for all, none served.
        # The highest serves, the others stand by; a restarted replica draws again.
        config.peering.priority = random.SystemRandom().randrange(1, 2**31)
    return config


def make_reconciler(settings: OperatorSettings) -> Reconciler:
    """The reconcile service, counting and timing its reconciles (`legorl.operator.metrics`)."""
    return MeteredReconciler(
        settings=settings,
        ctx=RenderContext(
            images=settings.images,
            default_store_uri=settings.default_store_uri,
            operator_namespace=settings.operator_namespace,
            trial_tracing=settings.trial_tracing,
        ),
    )


def run_operator(
    settings: OperatorSettings,
    *,
    login: LoginFn | None = None,
    reconciler: Reconciler | None = None,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
    liveness: bool = True,
) -> None:
    """Run until stopped (SIGINT/SIGTERM, or `stop_flag`)."""
    from legorl.telemetry.traces import tracer_provider_from_env  # noqa: PLC0415

    logging.getLogger("legorl").setLevel(settings.log_level)
    # Trial traces (the run controllers emit each collected trial's spans), when OTEL_* says where to.
    tracer_provider = tracer_provider_from_env("legorl-operator")
    memo: Any = kopf.Memo(reconciler=reconciler or make_reconciler(settings), tracer_provider=tracer_provider)
    try:
        kopf.run(
            registry=build_registry(login=login),
            settings=kopf_settings(settings),
            standalone=settings.peering is None,
            peering_name=settings.peering,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if liveness else None,
            memo=memo,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flushes the spans still queued
