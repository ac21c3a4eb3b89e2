"""The UI against a Kubernetes API (kmock's emulator, tests/support/kubeapi.py): RLRuns with their status,
conditions and events, the fleet's replicas (engine metrics from a real HTTP server in vLLM's Prometheus
format), the pool's image cache and self-test, trial pods by stage, and the token-gated actions patching
the RLRun. What the mock does not emulate (RBAC, field selectors) is not what these tests rely on."""

from __future__ import annotations

import http.server
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from legorl.ui.server import UiApp
from legorl.ui.settings import KubeSettings, UiSettings
from legorl.ui.synthetic import write_synthetic_store
from tests.support.kubeapi import MockApi

GV = "legorl.dev/v1alpha1"
TOKEN = "ui-action-token-for-tests"
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.42
"""


class _Engine(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/metrics":
            body, ctype = VLLM_METRICS.encode(), "text/plain; version=0.0.4"
        elif self.path == "/weight_info":
            body, ctype = b'{"weight_version": "v2"}', "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cluster-store") / "default" / "tiny-local"
    write_synthetic_store(
        root,
        name="tiny-local",
        steps=3,
        tasks_per_step=2,
        group_size=2,
        held_out_tasks=2,
        eval_every=3,
        seed=5,
    )
    return root


def _pod(name: str, *, component: str, phase: str, labels: dict[str, str], **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"legorl.dev/component": component, **labels},
            "annotations": {"legorl.dev/policy-version": "v2"} if component == "engine" else {},
        },
        "spec": {"containers": [{"name": "main", "image": "x"}], "nodeName": "node-a"},
        "status": {"phase": phase, **status},
    }


def _add_pod(api: MockApi, pod: dict[str, Any]) -> None:
    """Create a pod, then write its status as the kubelet would (create drops status)."""
    api.create(pod)
    api.set_status("v1", "pods", "default", pod["metadata"]["name"], pod["status"])


@pytest.fixture
def cluster(repo: Path, store: Path, engine: str) -> Iterator[MockApi]:
    run = yaml.safe_load((repo / "examples" / "tiny-local.yaml").read_text())
    run["metadata"]["namespace"] = "default"
    with MockApi() as api:
        api.create(run)
        api.set_status(
            GV,
            "rlruns",
            "default",
            "tiny-local",
            {
                "observedGeneration": 1,
                "phase": "Running",
                "step": 2,
                "policyVersion": "v2",
                "storeUri": f"file://{store}",
                "fleetName": "tiny-local-fleet",
                "poolName": "tiny-local-pool",
                "conditions": [
                    {
                        "type": "Validated",
                        "status": "True",
                        "reason": "Valid",
                        "message": "ok",
                        "lastTransitionTime": "2026-12-01T01:00:00Z",
                    },
                    {
                        "type": "Training",
                        "status": "True",
                        "reason": "StepInProgress",
                        "message": "step 3 of 3",
                        "lastTransitionTime": "2026-12-01T01:05:00Z",
                    },
                ],
                "preflight": [
                    {"check": "ImagesExist", "result": "Passed", "message": "all 4 task images resolve"},
                    {"check": "GpuCapacity", "result": "Warning", "message": "0 GPUs requested"},
                ],
                "metrics": {"rewardMean": 0.5, "heldOutSolveRate": 0.4, "fidelityCorrelation": 0.999},
                "trials": {"total": 12, "running": 2},
                "validation": {
                    "requested": "2026-12-01T01:00:00Z",
                    "state": "Failed",
                    "message": "token-parity Failed: Pearson 0.3100 over 25 tokens",
                    "startTime": "2026-12-01T01:00:02Z",
                    "completionTime": "2026-12-01T01:04:00Z",
                    "trial": "canary-585c87acd3",
                    "checks": [
                        {"check": "trial", "result": "Passed", "message": "completed, reward 1"},
                        {
                            "check": "token-parity",
                            "result": "Failed",
                            "message": "Pearson 0.3100 over 25 tokens",
                        },
                    ],
                },
            },
        )
        api.create(
            {
                "apiVersion": GV,
                "kind": "RolloutFleet",
                "metadata": {"name": "tiny-local-fleet", "namespace": "default"},
                "spec": {"replicas": 2, "model": {"uri": "hf://tiny"}},
            }
        )
        selector = "legorl.dev/owner=rolloutfleet.tiny-local-fleet,legorl.dev/component=engine"
        api.set_status(
            GV,
            "rolloutfleets",
            "default",
            "tiny-local-fleet",
            {
                "replicas": 2,
                "readyReplicas": 1,
                "selector": selector,
                "servedPolicyVersion": "v2",
                "endpoints": [
                    {"name": "tiny-local-fleet-0", "url": engine, "ready": True, "policyVersion": "v2"},
                    {"name": "tiny-local-fleet-1", "url": "http://127.0.0.1:9", "ready": False},
                ],
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "False",
                        "reason": "ReplicasNotReady",
                        "message": "1 of 2 replicas ready",
                        "lastTransitionTime": "2026-12-01T01:00:00Z",
                    }
                ],
            },
        )
        owner = {"legorl.dev/owner": "rolloutfleet.tiny-local-fleet"}
        _add_pod(api, _pod("tiny-local-fleet-0", component="engine", phase="Running", labels=owner))
        _add_pod(api, _pod("tiny-local-fleet-1", component="engine", phase="Pending", labels=owner))
        api.create(
            {
                "apiVersion": GV,
                "kind": "SandboxPool",
                "metadata": {"name": "tiny-local-pool", "namespace": "default"},
                "spec": {"source": {"taskSet": {"uri": "s3://tasks/x.jsonl"}}},
            }
        )
        api.set_status(
            GV,
            "sandboxpools",
            "default",
            "tiny-local-pool",
            {
                "imagesDesired": 4,
                "imagesCached": 3,
                "nodes": [
                    {
                        "name": "node-a",
                        "desired": 4,
                        "pulled": 3,
                        "failed": 1,
                        "failures": [{"image": "ghcr.io/x/task:1", "reason": "ImagePullBackOff"}],
                    }
                ],
                "selfTest": {
                    "result": "Failed",
                    "checks": [
                        {
                            "name": "egress",
                            "result": "Failed",
                            "message": "a connection to 1.1.1.1:443 succeeded",
                        },
                        {"name": "history", "result": "Passed"},
                    ],
                },
                "conditions": [
                    {
                        "type": "DefensesVerified",
                        "status": "False",
                        "reason": "SelfTestFailed",
                        "message": "egress",
                        "lastTransitionTime": "2026-12-01T01:00:00Z",
                    }
                ],
            },
        )
        run_labels = {"legorl.dev/run": "tiny-local"}
        _add_pod(
            api,
            _pod(
                "tiny-local-s3-t0-r0",
                component="trial",
                phase="Running",
                labels={**run_labels, "legorl.dev/trial": "s3-t0-r0"},
            ),
        )
        _add_pod(
            api,
            _pod(
                "tiny-local-s3-t0-r1",
                component="trial",
                phase="Pending",
                labels={**run_labels, "legorl.dev/trial": "s3-t0-r1"},
            ),
        )
        _add_pod(
            api,
            _pod(
                "tiny-local-s2-t1-r0-verify",
                component="verify",
                phase="Running",
                labels={**run_labels, "legorl.dev/trial": "s2-t1-r0"},
            ),
        )
        api.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": "tiny-local.1", "namespace": "default"},
                "involvedObject": {
                    "apiVersion": GV,
                    "kind": "RLRun",
                    "name": "tiny-local",
                    "namespace": "default",
                },
                "type": "Warning",
                "reason": "FidelityLow",
                "message": "correlation 0.95 below 0.99",
                "lastTimestamp": "2026-12-01T01:06:00Z",
                "count": 1,
            }
        )
        yield api


async def _client(settings: UiSettings) -> AsyncIterator[httpx.AsyncClient]:
    app = UiApp(settings)
    await app.startup()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
            yield client
    finally:
        await app.shutdown()


def _settings(mock: MockApi, token: str | None = TOKEN) -> UiSettings:
    return UiSettings(kube=KubeSettings(server=mock.url), action_token=token)


@pytest.mark.asyncio
async def test_cluster_runs_overview_fleet_and_sandboxes(cluster: MockApi) -> None:
    async for api in _client(_settings(cluster)):
        runs = (await api.get("/api/runs")).json()
        (row,) = runs["runs"]
        assert row["id"] == "default~tiny-local" and row["source"] == "cluster" and row["phase"] == "Running"
        assert {c["type"] for c in row["conditions"]} == {"Validated", "Training"}
        assert row["store_note"] is None and row["held_out"] == 0.4, (
            "status metrics, store figures beside them"
        )
        overview = (await api.get("/api/runs/default~tiny-local")).json()
        assert [p["check"] for p in overview["preflight"]] == ["ImagesExist", "GpuCapacity"]
        canary = overview["validation"]  # status.validation, the newest word on the run's canary
        assert (canary["source"], canary["state"], canary["time"]) == (
            "cluster",
            "Failed",
            "2026-12-01T01:04:00Z",
        )
        assert [c["result"] for c in canary["checks"]] == ["Passed", "Failed"]
        assert overview["events"][0]["reason"] == "FidelityLow"
        assert overview["spec"]["spec"]["harness"]["kind"] == "MiniSweAgent"
        assert overview["batches"], "the store named by status.storeUri is read"
        fleet = (await api.get("/api/runs/default~tiny-local/fleet")).json()
        assert fleet["available"] and fleet["served_policy_version"] == "v2"
        live, down = fleet["replicas"]
        assert (live["running"], live["waiting"], live["kv_usage"]) == (3.0, 5.0, 0.42)
        assert live["policy_version"] == "v2" and live["phase"] == "Running" and live["node"] == "node-a"
        assert down["ready"] is False and "unreachable" in down["metrics_note"]
        boxes = (await api.get("/api/runs/default~tiny-local/sandboxes")).json()
        assert boxes["available"] and boxes["stages"] == {"agent": 1, "scheduling": 1, "verify": 1}
        assert boxes["pool"]["images_cached"] == 3 and boxes["pool"]["self_test"]["result"] == "Failed"
        assert {p["trial"] for p in boxes["pods"]} == {"s3-t0-r0", "s3-t0-r1", "s2-t1-r0"}
        diagnostics = (await api.get("/api/runs/default~tiny-local/diagnostics")).json()
        assert diagnostics["available"], diagnostics
        trials = (await api.get("/api/runs/default~tiny-local/trials", params={"limit": 3})).json()
        assert trials["total"] > 3 and len(trials["items"]) == 3


@pytest.mark.asyncio
async def test_actions_patch_the_rlrun_only_with_the_token(cluster: MockApi) -> None:
    path = "/api/runs/default~tiny-local/actions"
    async for api in _client(_settings(cluster, token=None)):
        assert (await api.post(f"{path}/pause")).status_code == 403
    assert not cluster.fetch(GV, "rlruns", "default", "tiny-local")["spec"].get("suspend")
    async for api in _client(_settings(cluster)):
        r = await api.post(f"{path}/pause", headers={"Authorization": f"Bearer {TOKEN}x"})
        assert r.status_code == 401
        assert not cluster.fetch(GV, "rlruns", "default", "tiny-local")["spec"].get("suspend")
        r = await api.post(f"{path}/pause", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        assert cluster.fetch(GV, "rlruns", "default", "tiny-local")["spec"]["suspend"] is True
        r = await api.post(f"{path}/resume", headers={"Authorization": f"bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        assert cluster.fetch(GV, "rlruns", "default", "tiny-local")["spec"]["suspend"] is False
        r = await api.post(f"{path}/validate", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        annotations = cluster.fetch(GV, "rlruns", "default", "tiny-local")["metadata"]["annotations"]
        assert annotations["legorl.dev/validate-requested"].endswith("Z")
        r = await api.post(
            "/api/runs/default~gone/actions/pause", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert r.status_code == 404


@pytest.mark.asyncio
async def test_unreadable_store_and_unreachable_cluster_are_explained(
    cluster: MockApi, store: Path, tmp_path: Path
) -> None:
    cluster.set_status(GV, "rlruns", "default", "tiny-local", {"storeUri": "pvc://runs/default/tiny-local"})
    async for api in _client(_settings(cluster)):
        (row,) = (await api.get("/api/runs")).json()["runs"]
        assert "PersistentVolumeClaim" in row["store_note"]
        r = await api.get("/api/runs/default~tiny-local/curves")
        assert r.status_code == 409 and "--pvc-root" in r.json()["error"]["message"]
    mounted = tmp_path / "pvc" / "runs" / "default"
    mounted.mkdir(parents=True)
    shutil.copytree(store, mounted / "tiny-local")
    settings = UiSettings(
        kube=KubeSettings(server=cluster.url), store_roots=(("pvc://", str(tmp_path / "pvc")),)
    )
    async for api in _client(settings):
        (row,) = (await api.get("/api/runs")).json()["runs"]
        assert row["store_note"] is None and row["store"].endswith("runs/default/tiny-local")
    async for api in _client(
        UiSettings(stores=(str(store),), kube=KubeSettings(server="http://127.0.0.1:9"))
    ):
        data = (await api.get("/api/runs")).json()
        assert [r["id"] for r in data["runs"]] == ["tiny-local"]
        assert "unreachable" in data["cluster_note"]
