"""Observability end to end, below the chart: trial traces rebuilt from a TrialRecord, the run controller's
Progress as Prometheus metrics, the operator's and the trainer's metrics, and the Grafana dashboard, whose
every query names only metrics the code defines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.request
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf
import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from legorl.api.progress import Progress
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import TamperFinding, TrialRecord
from legorl.operator.handlers import build_registry
from legorl.operator.main import make_reconciler
from legorl.operator.metrics import (
    OPERATOR_METRICS,
    MeteredReconciler,
    OperatorMetrics,
    resource_state,
    start_metrics_server,
)
from legorl.operator.reconcile import TransientError
from legorl.operator.render.common import RenderContext
from legorl.operator.settings import OperatorSettings
from legorl.proxy.metrics import PROXY_METRICS, Metrics
from legorl.telemetry.metrics import (
    RUN_METRICS,
    ProgressMetrics,
    ProxyTotals,
    new_registry,
    progress_samples,
    serve_metrics,
)
from legorl.telemetry.traces import (
    emit_trial_spans,
    stage_layout,
    trace_headers,
    tracer_provider_from_env,
    trial_context,
    trial_id_generator,
    trial_span_id,
    trial_trace_id,
)
from legorl.trainer.telemetry import PROMETHEUS_PREFIX, STEP_FIGURES, TrainerTelemetry
from tests.operator.test_operator_integration import kopf_test_settings, manifests, operator_test_settings
from tests.support.asgi_server import free_port
from tests.support.kubeapi import MockApi, run_operator

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "legorl" / "dashboards" / "legorl.json"
T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def record(**changes: Any) -> TrialRecord:
    base = TrialRecord(
        run="r1",
        trial="r1-s3-g0-t1",
        task_id="task-7",
        group_id="g0",
        split="train",
        step=3,
        harness="mini-swe-agent",
        termination_reason=TerminationReason.COMPLETED,
        reward=1.0,
        started_at=T0,
        ended_at=T0 + timedelta(seconds=100),
        policy_versions=["v2", "v3"],
        num_turns=4,
        stage_seconds={"proxy_start": 1.0, "setup": 4.0, "agent_start": 0.5, "agent": 60.0, "verify": 20.0},
    )
    return replace(base, **changes)


def exporting() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=trial_id_generator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


# --- traces -----------------------------------------------------------------------------------------


def test_trial_ids_are_stable_and_distinct() -> None:
    assert trial_trace_id("r1", "t1") == trial_trace_id("r1", "t1")
    assert trial_trace_id("r1", "t1") != trial_trace_id("r1", "t2") != trial_trace_id("r2", "t1")
    assert 0 < trial_trace_id("r1", "t1") < 2**128 and 0 < trial_span_id("r1", "t1") < 2**64


def test_stage_layout_runs_stages_back_to_back() -> None:
    layout = {
        s: (start, end, parent)
        for s, start, end, parent in stage_layout(record().stage_seconds, T0, T0 + timedelta(seconds=100))
    }
    t0 = int(T0.timestamp() * 1e9)
    second = 1_000_000_000
    assert layout["proxy_start"] == (t0, t0 + second, None)
    assert layout["setup"] == (t0 + second, t0 + 5 * second, None)
    assert layout["agent"] == (t0 + 5 * second, t0 + 65 * second, None)
    assert layout["agent_start"] == (t0 + 5 * second, t0 + 5 * second + second // 2, "agent")
    assert layout["verify"] == (t0 + 65 * second, t0 + 85 * second, None)
    # Recorded durations longer than the trial (another machine's clock) end with the trial.
    short = stage_layout({"agent": 500.0, "custom": 1.0}, T0, T0 + timedelta(seconds=10))
    assert [(s, end) for s, _, end, _ in short] == [("agent", t0 + 10 * second), ("custom", t0 + 10 * second)]


def test_a_trial_becomes_a_root_span_with_a_span_per_stage() -> None:
    provider, exporter = exporting()
    emit_trial_spans(provider, record(), attributes={"k8s.namespace.name": "ns"})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "trial",
        "stage proxy_start",
        "stage setup",
        "stage agent",
        "stage agent_start",
        "stage verify",
    }
    root = spans["trial"]
    assert root.context is not None and root.parent is None
    assert root.context.trace_id == trial_trace_id("r1", "r1-s3-g0-t1")
    assert root.context.span_id == trial_span_id("r1", "r1-s3-g0-t1")
    attributes = dict(root.attributes or {})
    assert attributes["legorl.trial"] == "r1-s3-g0-t1"
    assert attributes["legorl.run"] == "r1" and attributes["legorl.step"] == 3
    assert attributes["legorl.policy_version"] == "v3"
    assert attributes["legorl.policy_versions"] == ("v2", "v3")
    assert attributes["legorl.termination_reason"] == "completed" and attributes["legorl.reward"] == 1.0
    assert attributes["k8s.namespace.name"] == "ns"
    assert root.start_time == int(T0.timestamp() * 1e9) and root.end_time == root.start_time + 100 * 10**9
    assert root.status.status_code == StatusCode.UNSET
    for name, span in spans.items():
        if name == "trial":
            continue
        assert span.context is not None and span.context.trace_id == root.context.trace_id
        assert (span.attributes or {})["legorl.trial"] == "r1-s3-g0-t1"
        parent = spans["stage agent"] if name == "stage agent_start" else root
        assert span.parent is not None and parent.context is not None
        assert span.parent.span_id == parent.context.span_id
    assert spans["stage verify"].end_time - spans["stage verify"].start_time == 20 * 10**9  # type: ignore[operator]


def test_an_infra_failure_is_an_error_span() -> None:
    provider, exporter = exporting()
    failing = record(
        termination_reason=TerminationReason.SANDBOX_ERROR,
        reward=None,
        error="the trial pod was evicted",
        stage_seconds={"setup": 2.0},
        tamper_findings=[TamperFinding(kind="egress_attempt", detail="connect to 1.2.3.4")],
    )
    emit_trial_spans(provider, failing)
    [root] = [s for s in exporter.get_finished_spans() if s.name == "trial"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.status.description == "the trial pod was evicted"
    assert "legorl.reward" not in (root.attributes or {})
    assert (root.attributes or {})["legorl.tamper_kinds"] == ("egress_attempt",)


def test_the_proxys_spans_join_the_trial_trace() -> None:
    """A proxy span parented on `trial_context` and the collector's root span share trace and span ids."""
    provider, exporter = exporting()
    tracer = provider.get_tracer("legorl.proxy")
    with tracer.start_as_current_span(
        "proxy openai_chat", context=trial_context("r1", "r1-s3-g0-t1"), kind=SpanKind.SERVER
    ):
        headers = trace_headers()
    emit_trial_spans(provider, record())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    call, root = spans["proxy openai_chat"], spans["trial"]
    assert call.parent is not None and root.context is not None and call.context is not None
    assert call.parent.span_id == root.context.span_id
    assert call.context.trace_id == root.context.trace_id
    assert headers["traceparent"] == f"00-{root.context.trace_id:032x}-{call.context.span_id:016x}-01"


def test_no_provider_no_cost() -> None:
    emit_trial_spans(None, record())  # nothing to do, nothing raised
    assert trace_headers() == {}  # no span is current


def test_tracer_provider_from_env() -> None:
    assert tracer_provider_from_env("legorl-test", env={}) is None
    assert (
        tracer_provider_from_env(
            "legorl-test",
            env={"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
        )
        is None
    )
    assert (
        tracer_provider_from_env(
            "legorl-test", env={"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
        )
        is None
    )
    for env in (
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"},
    ):
        provider = tracer_provider_from_env("legorl-test", attributes={"legorl.run": "r1"}, env=env)
        assert provider is not None
        assert provider.resource.attributes["service.name"] == "legorl-test"
        assert provider.resource.attributes["legorl.run"] == "r1"
        provider.shutdown()
    named = tracer_provider_from_env(
        "legorl-test", endpoint="http://127.0.0.1:9/v1/traces", env={"OTEL_SERVICE_NAME": "mine"}
    )
    assert named is not None and named.resource.attributes["service.name"] == "mine"
    named.shutdown()


# --- the run controller's metrics -------------------------------------------------------------------


def scrape(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_progress_becomes_metrics() -> None:
    progress = Progress(
        run="r1",
        step=4,
        policy_version="v4",
        max_steps=10,
        trials_total=9,
        trials_running=3,
        trials_dropped=2,
        by_reason={"completed": 7, "engine_error": 2},
        reward_mean=0.5,
        fidelity_correlation=float("nan"),
        phase_seconds={"agent": 120.0, "verify": 30.0},
        degraded_reason="FidelityBelowThreshold",
    )
    registry = new_registry()
    metrics = ProgressMetrics(registry)
    metrics.update(progress, namespace="ns")
    progress.step = 5  # the controller goes on: what was taken is a copy
    got = scrape(registry)
    labels = (("namespace", "ns"), ("run", "r1"))
    assert got[("legorl_run_step", labels)] == 4
    assert got[("legorl_run_policy_version", labels)] == 4
    assert got[("legorl_run_max_steps", labels)] == 10
    assert got[("legorl_run_trials_running", labels)] == 3
    assert got[("legorl_run_trials_total", (*labels[:1], ("reason", "completed"), labels[1]))] == 7
    assert got[("legorl_run_trials_total", (*labels[:1], ("reason", "engine_error"), labels[1]))] == 2
    assert got[("legorl_run_trials_dropped_total", labels)] == 2
    assert got[("legorl_run_stage_seconds_total", (*labels, ("stage", "agent")))] == 120
    assert got[("legorl_run_reward_mean", labels)] == 0.5
    assert got[("legorl_run_degraded", labels)] == 1
    assert ("legorl_run_fidelity_correlation", labels) not in got  # NaN: not known, not exported
    assert not [key for key in got if "trial" in dict(key[1])]  # never a trial id as a label
    metrics.forget("r1", namespace="ns")
    assert not [k for k in scrape(registry) if k[0].startswith("legorl_run_")]


def test_every_progress_sample_is_catalogued() -> None:
    progress = Progress(
        run="r",
        max_steps=3,
        reward_mean=1.0,
        held_out_solve_rate=0.5,
        baseline_solve_rate=0.2,
        fidelity_correlation=0.99,
        max_abs_logprob_delta=0.1,
        tokens_per_second=5.0,
        trials_per_minute=2.0,
        eta_seconds=60.0,
        by_reason={"completed": 1},
        phase_seconds={"agent": 1.0},
    )
    names = {s.name for s in progress_samples(progress)}
    assert names == set(RUN_METRICS)
    with pytest.raises(AttributeError):
        progress_samples(object())  # type: ignore[arg-type]


def test_serve_metrics() -> None:
    registry = new_registry()
    ProgressMetrics(registry).update(Progress(run="r1", step=2))
    server = serve_metrics(registry, 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        server.close()
    assert 'legorl_run_step{namespace="",run="r1"} 2.0' in body


def test_finished_proxies_are_summed() -> None:
    registry = new_registry()
    totals = ProxyTotals(registry)
    for status in ("503", "503", "400"):
        proxy = Metrics()
        proxy.inc("legorl_proxy_requests_total", api_format="openai_chat", outcome="ok")
        proxy.inc("legorl_proxy_upstream_errors_total", status=status)
        proxy.observe("legorl_proxy_request_seconds", 0.3, api_format="openai_chat")
        proxy.set("legorl_proxy_turns", 7)
        totals.add(proxy.render(), namespace="ns", run="r1")
    got = scrape(registry)
    run = (("namespace", "ns"), ("run", "r1"))
    assert (
        got[
            (
                "legorl_proxy_requests_total",
                (("api_format", "openai_chat"), *run[:1], ("outcome", "ok"), run[1]),
            )
        ]
        == 3
    )
    assert got[("legorl_proxy_upstream_errors_total", (*run, ("status", "503")))] == 2
    assert got[("legorl_proxy_upstream_errors_total", (*run, ("status", "400")))] == 1
    assert got[("legorl_proxy_request_seconds_count", (("api_format", "openai_chat"), *run))] == 3
    assert (
        got[("legorl_proxy_request_seconds_bucket", (("api_format", "openai_chat"), ("le", "0.5"), *run))]
        == 3
    )
    assert (
        got[("legorl_proxy_request_seconds_bucket", (("api_format", "openai_chat"), ("le", "0.25"), *run))]
        == 0
    )
    assert not [key for key in got if key[0] == "legorl_proxy_turns"]  # one trial's gauge: not summed
    with pytest.raises(ValueError):
        totals.add("legorl_proxy_requests_total{outcome=ok 1\n")


# --- the operator's metrics -------------------------------------------------------------------------


def reconciler() -> MeteredReconciler:
    return MeteredReconciler(
        settings=OperatorSettings(settle_seconds=0), ctx=RenderContext(), discovered=True
    )


def test_resource_state() -> None:
    def cond(type_: str, status: str) -> dict[str, str]:
        return {"type": type_, "status": status}

    assert resource_state("RLRun", {}) == "Unknown"
    assert (
        resource_state("RLRun", {"status": {"phase": "Running", "conditions": [cond("Training", "True")]}})
        == "Running"
    )
    assert resource_state("RolloutFleet", {"status": {"conditions": [cond("Ready", "True")]}}) == "Ready"
    assert resource_state("SandboxPool", {"status": {"conditions": [cond("Ready", "False")]}}) == "NotReady"
    degraded = {"status": {"conditions": [cond("Ready", "True"), cond("Degraded", "True")]}}
    assert resource_state("RolloutFleet", degraded) == "Degraded"


def test_reconciles_are_counted_and_timed() -> None:
    rec = reconciler()
    fleet = {"kind": "RolloutFleet", "metadata": {"name": "f", "namespace": "ns"}}
    rec.store.objects[("RolloutFleet", "ns", "f")] = fleet
    outcomes = iter([None, TransientError("API server busy"), RuntimeError("bug")])

    async def fake_fleet(body: dict[str, Any]) -> None:
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    rec._reconcile_fleet = fake_fleet  # type: ignore[method-assign]

    async def run() -> None:
        await rec.reconcile(("RolloutFleet", "ns", "f"))
        with pytest.raises(TransientError):
            await rec.reconcile(("RolloutFleet", "ns", "f"))
        with pytest.raises(RuntimeError):
            await rec.reconcile(("RolloutFleet", "ns", "f"))
        await rec.reconcile(("RolloutFleet", "ns", "gone"))  # nothing to reconcile: not counted

    asyncio.run(run())
    got = scrape(rec.metrics.registry)
    fleet_labels = (("kind", "RolloutFleet"),)
    for result in ("ok", "transient", "error"):
        assert got[("legorl_operator_reconciles_total", (*fleet_labels, ("result", result)))] == 1
    assert got[("legorl_operator_reconcile_errors_total", fleet_labels)] == 2
    assert got[("legorl_operator_reconcile_seconds_count", fleet_labels)] == 3
    assert got[("legorl_operator_reconciles_total", (("kind", "RLRun"), ("result", "ok")))] == 0


def test_cache_gauges_and_the_endpoint() -> None:
    rec = reconciler()
    rec.store.objects[("RLRun", "ns", "r")] = {
        "status": {"phase": "Running", "conditions": [{"type": "Training", "status": "True"}]}
    }
    rec.store.objects[("SandboxPool", "ns", "p")] = {}
    rec.store.pod_event(
        "ns",
        {
            "metadata": {
                "name": "t1",
                "labels": {"legorl.dev/owner": "rlrun.r", "legorl.dev/component": "trial"},
            },
            "status": {"phase": "Running"},
        },
        deleted=False,
    )
    rec.store.pod_event(
        "ns",
        {
            "metadata": {
                "name": "v1",
                "labels": {"legorl.dev/owner": "rlrun.r", "legorl.dev/component": "verify"},
            },
            "status": {"phase": "Pending"},
        },
        deleted=False,
    )
    rec.metrics.runs.update(Progress(run="r", step=1), namespace="ns")

    async def fetch() -> str:
        import aiohttp  # noqa: PLC0415

        runner = await start_metrics_server(rec.metrics.registry, 0, host="127.0.0.1")
        try:
            port = runner.addresses[0][1]
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/metrics") as response,
            ):
                assert response.headers["Content-Type"].startswith("text/plain; version=")
                return await response.text()
        finally:
            await runner.cleanup()

    text = asyncio.run(fetch())
    assert 'legorl_operator_resources{kind="RLRun",state="Running"} 1.0' in text
    assert 'legorl_operator_resources{kind="SandboxPool",state="Unknown"} 1.0' in text
    assert 'legorl_operator_pods{component="trial",phase="Running"} 1.0' in text
    assert 'legorl_operator_pods{component="verify",phase="Pending"} 1.0' in text
    assert "legorl_operator_dirty_objects 1.0" in text  # the pod events marked the run
    assert 'legorl_run_step{namespace="ns",run="r"} 1.0' in text


def test_the_operator_serves_its_metrics() -> None:
    """kopf for real against the API mock: the startup handler serves /metrics, reconciles count."""
    settings = operator_test_settings(metrics_port=free_port())
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    with MockApi() as mock:
        registry = build_registry(login=lambda **_: kopf.ConnectionInfo(server=mock.url))
        memo = kopf.Memo(reconciler=make_reconciler(settings))
        with run_operator(mock, registry, memo=memo, settings=kopf_test_settings(settings)):
            mock.create(manifests("shared-fleet-and-pool.yaml")[0])
            deadline = time.monotonic() + 30
            text = ""

            def reconciled(text: str) -> bool:
                ok = re.search(
                    r'legorl_operator_reconciles_total\{kind="RolloutFleet",result="ok"\} (\S+)', text
                )
                return ok is not None and float(ok.group(1)) >= 1

            # The gauge reads the stored status, which lands while the reconcile that wrote it is
            # still running; the counter counts it when it returns. A scrape in between sees the
            # first and not yet the second, so wait for both.
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(url, timeout=5) as response:
                        text = response.read().decode()
                    if (
                        'legorl_operator_resources{kind="RolloutFleet",state="NotReady"} 1.0' in text
                        and reconciled(text)
                    ):
                        break
                time.sleep(0.2)
            assert 'legorl_operator_resources{kind="RolloutFleet",state="NotReady"} 1.0' in text, text
            assert isinstance(memo["metrics"], OperatorMetrics)
    assert reconciled(text), text


def test_a_plain_reconciler_gets_state_gauges_without_timings() -> None:
    """What the startup handler makes for a reconciler that does not count its reconciles."""
    plain = OperatorMetrics(reconciler())
    plain.reconciler.store.objects[("RolloutFleet", "ns", "f")] = {}  # type: ignore[union-attr]
    got = scrape(plain.registry)
    assert got[("legorl_operator_resources", (("kind", "RolloutFleet"), ("state", "Unknown")))] == 1
    assert got[("legorl_operator_reconciles_total", (("kind", "RolloutFleet"), ("result", "ok")))] == 0
    # Without a reconciler, the state gauges have no samples.
    assert not [key for key in scrape(OperatorMetrics().registry) if key[0] == "legorl_operator_resources"]


# --- the trainer's metrics --------------------------------------------------------------------------


def test_trainer_figures_become_prometheus_gauges() -> None:
    registry = new_registry()
    telemetry = TrainerTelemetry(NoOpMeterProvider(), run="r1", registry=registry)
    telemetry.record(
        3,
        {
            "step_seconds": 12.5,
            "fidelity_pearson": 0.995,
            "reward_mean": 0.25,
            "sync_seconds": 2.0,
            "entropy": float("nan"),
        },
    )
    got = scrape(registry)
    run = (("run", "r1"),)
    assert got[("legorl_trainer_step", run)] == 3
    assert got[("legorl_trainer_steps_total", run)] == 1
    assert got[("legorl_trainer_step_seconds", run)] == 12.5
    assert got[("legorl_trainer_fidelity_pearson", run)] == 0.995
    assert got[("legorl_trainer_reward_mean", run)] == 0.25
    assert got[("legorl_trainer_sync_seconds", run)] == 2.0
    assert ("legorl_trainer_entropy", run) not in got  # NaN: not known, not exported
    assert ("legorl_trainer_kl_ref", run) not in got  # never reported: absent, not 0


# --- the dashboard ----------------------------------------------------------------------------------


def defined_series() -> set[str]:
    """Every series name the code exposes: catalogued names, histogram parts, the trainer's gauges."""
    catalogue: dict[str, str] = {name: kind for name, kind, _ in PROXY_METRICS}
    catalogue |= {name: kind for name, (kind, _) in (OPERATOR_METRICS | RUN_METRICS).items()}
    catalogue |= {f"{PROMETHEUS_PREFIX}{name}": "gauge" for name in ("step", *STEP_FIGURES)}
    catalogue[f"{PROMETHEUS_PREFIX}steps_total"] = "counter"
    series = set()
    for name, kind in catalogue.items():
        series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return series


def test_the_catalogues_match_what_is_exposed() -> None:
    """The catalogues the dashboard is checked against are what the registries really expose."""
    rec = reconciler()
    operator_text = generate_latest(rec.metrics.registry).decode()
    exposed = {f.name for f in text_string_to_metric_families(operator_text)}
    registry = new_registry()
    TrainerTelemetry(NoOpMeterProvider(), run="r", registry=registry)
    exposed |= {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    exposed |= {line.split()[2] for line in Metrics().render().splitlines() if line.startswith("# TYPE")}
    # prometheus-client adds a `<name>_created` series to counters and histograms (when they started).
    exposed = {n for n in exposed if not n.endswith("_created")}
    # The parser names counter families without their `_total`.
    catalogued = (
        {n.removesuffix("_total") for n, _, _ in PROXY_METRICS}
        | {n.removesuffix("_total") for n in (*OPERATOR_METRICS, *RUN_METRICS)}
        | {f"{PROMETHEUS_PREFIX}{n}" for n in ("step", "steps", *STEP_FIGURES)}
    )
    assert {n.removesuffix("_total") for n in exposed} == catalogued


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                queries.append((panel["title"], target["expr"]))
            if panel["type"] != "row":
                assert panel.get("targets"), f"panel {panel['title']!r} has no query"
                assert panel.get("description"), f"panel {panel['title']!r} has no description"

    walk(board["panels"])
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            queries.append((f"${variable['name']}", variable["query"]["query"]))
    return queries


def test_dashboard_is_valid_and_queries_only_defined_metrics() -> None:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert board["uid"] and board["title"] == "legorl"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    defined = defined_series()
    queries = dashboard_queries()
    assert len(queries) > 20
    used: set[str] = set()
    for title, expr in queries:
        names = set(re.findall(r"\b(legorl_[a-z0-9_]+)\b", expr))
        assert names, f"{title}: {expr} queries no legorl metric"
        unknown = names - defined
        assert not unknown, f"{title}: {expr} names metrics no code defines: {sorted(unknown)}"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), f"{title}: {expr}"
        used |= names
    # The headline figures of the issue are on it.
    assert {
        "legorl_run_fidelity_correlation",
        "legorl_run_reward_mean",
        "legorl_trainer_step_seconds",
        "legorl_trainer_sync_seconds",
        "legorl_proxy_upstream_errors_total",
        "legorl_operator_reconciles_total",
        "legorl_operator_pods",
    } <= used
