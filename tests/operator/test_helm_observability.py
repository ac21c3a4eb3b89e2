"""The chart's observability: the operator's metrics port and Service, the optional ServiceMonitor, the
Grafana dashboard ConfigMap, and the tracing environment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.operator.test_helm import (
    CHART,
    FULLNAME,
    NAMESPACE,
    OPERATOR_ROLE,
    RELEASE,
    named,
    of_kind,
    render,
    run_helm,
)

pytestmark = [pytest.mark.helm, pytest.mark.integration]

MONITORING = "monitoring.coreos.com/v1/ServiceMonitor"
EVERYTHING = [
    "metrics.serviceMonitor.enabled=true",
    "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
    "metrics.dashboard.enabled=true",
    "tracing.otlpEndpoint=http://otel-collector.observability:4318",
    "tracing.trialCollectorPeer.podSelector.matchLabels.app=otel-collector",
]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = named(docs, "Deployment", OPERATOR_ROLE)["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


def template(helm: str, *args: str) -> list[dict[str, Any]]:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_metrics_are_served_by_default(helm: str) -> None:
    docs = render(helm)
    container = operator_container(docs)
    assert "--metrics-port=9090" in container["args"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    service = named(docs, "Service", f"{FULLNAME}-operator-metrics")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = named(docs, "Deployment", OPERATOR_ROLE)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert not of_kind(docs, "ServiceMonitor") and not of_kind(docs, "ConfigMap")
    assert not [e for e in container["env"] if e["name"].startswith("OTEL_")]


def test_metrics_can_be_turned_off(helm: str) -> None:
    docs = render(helm, ["metrics.enabled=false", "metrics.serviceMonitor.enabled=true"])
    container = operator_container(docs)
    assert not [a for a in container["args"] if a.startswith("--metrics-port")]
    assert [p["name"] for p in container["ports"]] == ["health"]
    assert not of_kind(docs, "Service") and not of_kind(docs, "ServiceMonitor")


@pytest.mark.parametrize(
    ("value", "api", "rendered"),
    [("false", True, False), ("auto", False, False), ("auto", True, True), ("true", False, True)],
)
def test_service_monitor(helm: str, value: str, api: bool, rendered: bool) -> None:
    extra = ["--api-versions", MONITORING] if api else []
    docs = template(helm, "--set", f"metrics.serviceMonitor.enabled={value}", *extra)
    monitors = of_kind(docs, "ServiceMonitor")
    assert len(monitors) == int(rendered)
    if not rendered:
        return
    [monitor] = monitors
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = named(docs, "Service", f"{FULLNAME}-operator-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


def test_service_monitor_labels_and_timeout(helm: str) -> None:
    docs = render(helm, [*EVERYTHING, "metrics.serviceMonitor.scrapeTimeout=10s"])
    [monitor] = of_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["scrapeTimeout"] == "10s"


def test_dashboard_config_map_carries_the_dashboard(helm: str) -> None:
    docs = render(
        helm, ["metrics.dashboard.enabled=true", "metrics.dashboard.annotations.grafana_folder=legorl"]
    )
    config_map = named(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "legorl"}
    shipped = json.loads((CHART / "dashboards" / "legorl.json").read_text(encoding="utf-8"))
    assert json.loads(config_map["data"]["legorl.json"]) == shipped

    elsewhere = render(helm, ["metrics.dashboard.enabled=true", "metrics.dashboard.namespace=monitoring"])
    assert named(elsewhere, "ConfigMap", f"{FULLNAME}-dashboard")["metadata"]["namespace"] == "monitoring"


def test_tracing_environment(helm: str) -> None:
    docs = render(
        helm,
        [
            "tracing.otlpEndpoint=http://collector:4318",
            "tracing.sampler=traceidratio",
            "tracing.samplerArg=0.25",
        ],
    )
    env = {e["name"]: e.get("value") for e in operator_container(docs)["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
    assert env["OTEL_TRACES_SAMPLER"] == "traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"


def test_trial_proxies_export_only_with_a_collector_peer(helm: str) -> None:
    peer = (
        "tracing.trialCollectorPeer.namespaceSelector.matchLabels."
        "kubernetes\\.io/metadata\\.name=observability"
    )
    env = {
        e["name"]: e.get("value")
        for e in operator_container(render(helm, ["tracing.otlpEndpoint=http://collector:4318", peer]))["env"]
    }
    assert json.loads(env["LEGORL_TRIAL_TRACING_PEER"]) == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}
    }
    plain = {
        e["name"]
        for e in operator_container(render(helm, ["tracing.otlpEndpoint=http://collector:4318"]))["env"]
    }
    assert "LEGORL_TRIAL_TRACING_PEER" not in plain
    alone = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", peer)
    assert alone.returncode != 0 and "needs tracing.otlpEndpoint" in alone.stderr


@pytest.mark.parametrize("k8s_version", ["1.30", "1.33"])
def test_everything_on_validates(helm: str, k8s_version: str) -> None:
    lint = run_helm(helm, "lint", "--strict", str(CHART), *(f for v in EVERYTHING for f in ("--set", v)))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    for doc in render(helm, EVERYTHING):
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD of prometheus-operator: not in the upstream schemas (checked above)
        kubernetes_validate.validate(doc, k8s_version, strict=True)


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("metrics.serviceMonitor.enabled=maybe", "enabled"),
        ("metrics.port=80", "port"),
        ("metrics.serviceMonitor.interval=often", "interval"),
        ("metrics.dashboard.namespace=Bad_NS", "namespace"),
        ("tracing.otlpEndpoint=ftp://collector", "otlpEndpoint"),
        ("metrics.unknown=1", "unknown"),
    ],
)
def test_schema_rejects_bad_observability_values(helm: str, value: str, key: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", value)
    assert result.returncode != 0, f"helm template accepted --set {value}"
    assert key in result.stderr, result.stderr


def test_metrics_port_must_differ_from_the_health_port(helm: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--set", "metrics.port=8080")
    assert result.returncode != 0
    assert "metrics.port must differ from operator.healthPort" in result.stderr


def test_chart_ships_the_dashboard() -> None:
    assert (Path(CHART) / "dashboards" / "legorl.json").is_file()
