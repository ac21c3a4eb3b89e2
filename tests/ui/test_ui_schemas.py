"""Every JSON route of the UI declares its answer's model (`legorl.ui.schemas`), and what it sends is that
model: each real answer, over the recorded run, a synthetic store and a cluster (a fake Kubernetes source
whose statuses include ones an older or newer operator could write), validates against its route's model
and writes back as it came."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Route

from legorl.ui.schemas import Schema, to_json_bytes
from legorl.ui.server import ApiRoute, UiApp
from legorl.ui.settings import UiSettings
from legorl.ui.synthetic import write_synthetic_store

FIXTURE = Path(__file__).parents[1] / "fixtures" / "ui-run" / "store"
CONDITION = {
    "type": "Ready",
    "status": "False",
    "reason": "NotYet",
    "lastTransitionTime": "2026-12-01T01:00:00Z",
}
RUN_STATUS: dict[str, Any] = {
    "phase": "Running",
    "step": 2,
    "policyVersion": "v2",
    "fleetName": "tiny-local-fleet",
    "poolName": "tiny-local-pool",
    "conditions": [CONDITION],
    "preflight": [{"check": "ImagesExist", "result": "Passed"}],
    "metrics": {"rewardMean": 0.5, "heldOutSolveRate": 0.4},
    "trials": {"total": 12, "running": 2},
    "validation": {
        "requested": "2026-12-01T01:00:00Z",
        "state": "Failed",
        "completionTime": "2026-12-01T01:04:00Z",
        "checks": [{"check": "token-parity", "result": "Failed", "message": "Pearson 0.31"}],
    },
}
FLEET_STATUS: dict[str, Any] = {
    "readyReplicas": 1,
    "selector": "legorl.dev/component=engine",
    "servedPolicyVersion": "v2",
    "endpoints": [
        {"name": "tiny-local-fleet-0", "url": "http://engine", "ready": True, "policyVersion": "v2"}
    ],
    "conditions": [CONDITION],
}
POOL_STATUS: dict[str, Any] = {
    "imagesDesired": 4,
    "imagesCached": 3,
    "nodes": [{"name": "node-a", "desired": 4, "pulled": 3}],
    "selfTest": {"result": "Passed", "checks": [{"name": "egress", "result": "Passed"}]},
    "conditions": [CONDITION],
}
ODD = {
    "run": {
        **RUN_STATUS,
        "phase": "Paused",  # a phase this UI does not know
        "step": "3",
        "fromANewerOperator": {"x": 1},
        "metrics": {"rewardMean": "high", "aNewFigure": 1.0},
        "trials": {"total": -1},
        "validation": {"state": "Passed"},  # without `requested`
        "fleetName": 7,
    },
    "fleet": {**FLEET_STATUS, "readyReplicas": "one", "endpoints": [{"name": "half-an-endpoint"}]},
    "pool": {
        **POOL_STATUS,
        "selfTest": {"result": "Weird"},
        "nodes": [{"desired": 1}],
        "leasedReplicas": None,
    },
}


class FakeKube:
    """The UI's Kubernetes source over a fixed list of objects (enough for the shapes of its answers)."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects

    async def close(self) -> None:
        return None

    async def list_objects(self, kind: str, namespace: str | None = None, **_: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for o in self.objects if o["kind"] == kind]

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        return copy.deepcopy(found[0]) if found else None

    async def pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for o in self.objects
            if o["kind"] == "Pod" and all(o["metadata"]["labels"].get(k) == v for k, v in labels.items())
        ]

    async def events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        involved = {"kind": kind, "name": name}
        return [
            copy.deepcopy(o) for o in self.objects if o["kind"] == "Event" and o["involvedObject"] == involved
        ]

    async def patch_run(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return {}


def _cluster(
    repo: Path, store: Path, run: dict[str, Any], fleet: dict[str, Any], pool: dict[str, Any]
) -> FakeKube:
    rlrun = yaml.safe_load((repo / "examples" / "tiny-local.yaml").read_text())
    rlrun["metadata"]["namespace"] = "default"
    rlrun["status"] = {**run, "storeUri": f"file://{store}"}
    pod_status = {
        "phase": "Running",
        "startTime": "2026-12-01T01:00:00Z",
        "containerStatuses": [{"restartCount": 1}],
    }
    return FakeKube(
        [
            rlrun,
            {
                "kind": "RolloutFleet",
                "metadata": {"name": "tiny-local-fleet"},
                "spec": {"replicas": 1},
                "status": fleet,
            },
            {"kind": "SandboxPool", "metadata": {"name": "tiny-local-pool"}, "status": pool},
            {
                "kind": "Pod",
                "metadata": {"name": "tiny-local-fleet-0", "labels": {"legorl.dev/component": "engine"}},
                "spec": {"nodeName": "node-a"},
                "status": pod_status,
            },
            {
                "kind": "Pod",
                "metadata": {
                    "name": "t0",
                    "labels": {"legorl.dev/run": "tiny-local", "legorl.dev/trial": "t0"},
                },
                "status": pod_status,
            },
            {
                "kind": "Event",
                "involvedObject": {"kind": "RLRun", "name": "tiny-local"},
                "type": "Warning",
                "reason": "FidelityLow",
                "message": "correlation 0.95",
                "count": 1,
                "lastTimestamp": "2026-12-01T01:06:00Z",
            },
        ]
    )


def _engine(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/metrics":
        return httpx.Response(200, text="vllm:num_requests_running 3.0\nvllm:kv_cache_usage_perc 0.42\n")
    return httpx.Response(404)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("schemas") / "store"
    write_synthetic_store(
        root, name="synth", steps=2, tasks_per_step=2, group_size=2, held_out_tasks=1, eval_every=2
    )
    return root


def _app(kube: FakeKube | None = None, **settings: Any) -> UiApp:
    http = httpx.AsyncClient(transport=httpx.MockTransport(_engine))
    return UiApp(UiSettings(action_token="token", **settings), kube=kube, http=http)  # type: ignore[arg-type]


async def _answers(app: UiApp) -> AsyncIterator[tuple[str, Any]]:
    """(path, JSON) of every GET and action endpoint of every run the app knows, each answered 200."""
    await app.startup()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:

            async def ask(path: str, method: str = "GET") -> Any:
                r = await client.request(method, path, headers={"Authorization": "Bearer token"})
                assert r.status_code == 200, (path, r.text)
                return r.json()

            paths = ["/healthz", "/api/info", "/api/rules", "/api/runs"]
            runs = await ask("/api/runs")
            ids = [row["id"] for row in runs["runs"]]
            for run in ids:
                base = f"/api/runs/{run}"
                paths += [base + p for p in ("", "/curves", "/outcomes", "/tasks", "/fleet", "/sandboxes")]
                paths += [f"{base}/diagnostics", f"{base}/trials?limit=3&sort=reward&order=desc"]
                trial = (await ask(f"{base}/trials?limit=1&split=train"))["items"][0]["trial"]
                paths.append(f"{base}/trials/{trial}")
            if len(ids) > 1:
                paths.append(f"/api/compare?runs={ids[0]},{ids[1]}")
            for path in paths:
                yield path, await ask(path)
            if any("~" in run for run in ids):
                path = f"/api/runs/{ids[0]}/actions/pause"
                yield path, await ask(path, "POST")
    finally:
        await app.shutdown()


def _model_of(app: UiApp, path: str) -> type[Schema]:
    bare = path.split("?", maxsplit=1)[0]
    for route in app.app.routes:
        if isinstance(route, ApiRoute) and route.path_regex.fullmatch(bare):
            return route.response_model
    raise AssertionError(f"no JSON route answers {path}")


def test_every_json_route_declares_its_answer() -> None:
    app = UiApp(UiSettings())
    routes = [r for r in app.app.routes if isinstance(r, Route)]
    json_routes = [r for r in routes if r.path.startswith("/api/") or r.path == "/healthz"]
    assert len(json_routes) >= 15
    for route in json_routes:
        assert isinstance(route, ApiRoute), f"{route.path} is not an ApiRoute"
        assert issubclass(route.response_model, Schema), route.path
    assert {r.path for r in routes} - {r.path for r in json_routes} == {
        "/",
        "/index.html",
        "/static/{name:path}",
    }


def test_a_handler_without_a_declared_answer_is_refused() -> None:
    async def handler(request: Any) -> dict[str, Any]:
        return {}

    with pytest.raises(TypeError, match="must declare the Schema it returns"):
        ApiRoute("/api/nothing", handler)  # type: ignore[arg-type]


async def _check(app: UiApp) -> set[str]:
    """Every answer validates against its route's model and writes back as it came; the models seen."""
    seen = set()
    async for path, body in _answers(app):
        model = _model_of(app, path)
        answer = model.model_validate(body)
        assert json.loads(to_json_bytes(answer)) == body, path
        seen.add(model.__name__)
    return seen


@pytest.mark.asyncio
async def test_answers_over_run_stores_are_their_declared_models(synthetic: Path) -> None:
    seen = await _check(_app(stores=(str(FIXTURE), str(synthetic))))
    assert {"Overview", "Trajectory", "TrialPage", "Compare", "Fleet", "Sandboxes", "Diagnostics"} <= seen


@pytest.mark.asyncio
@pytest.mark.parametrize("statuses", ["as-written", "odd"])
async def test_answers_over_a_cluster_are_their_declared_models(
    repo: Path, synthetic: Path, statuses: str
) -> None:
    """Statuses an older or newer operator could write (unknown fields and phases, values of another type,
    parts missing) still answer, with what validates."""
    odd = statuses == "odd"
    run, fleet, pool = (
        (ODD["run"], ODD["fleet"], ODD["pool"]) if odd else (RUN_STATUS, FLEET_STATUS, POOL_STATUS)
    )
    seen = await _check(_app(_cluster(repo, synthetic, run, fleet, pool)))
    assert {"ActionDone", "Fleet", "Sandboxes", "Overview"} <= seen


@pytest.mark.asyncio
async def test_the_cluster_s_word_is_read_typed(repo: Path, synthetic: Path) -> None:
    app = _app(_cluster(repo, synthetic, RUN_STATUS, FLEET_STATUS, POOL_STATUS))
    answers = {path: body async for path, body in _answers(app)}
    base = "/api/runs/default~tiny-local"
    (row,) = answers["/api/runs"]["runs"]
    assert (row["phase"], row["step"], row["held_out"], row["trials_total"]) == ("Running", 2, 0.4, 12)
    assert row["conditions"] == [CONDITION], "a status's parts are shown as the API server holds them"
    overview = answers[base]
    assert (
        overview["preflight"] == RUN_STATUS["preflight"]
        and overview["status"]["fleetName"] == "tiny-local-fleet"
    )
    assert (overview["validation"]["time"], overview["validation"]["message"]) == (
        "2026-12-01T01:04:00Z",
        None,
    )
    fleet = answers[f"{base}/fleet"]
    assert (fleet["ready_replicas"], fleet["spec_replicas"], fleet["replicas"][0]["running"]) == (1, 1, 3.0)
    pool = answers[f"{base}/sandboxes"]["pool"]
    assert pool["self_test"] == POOL_STATUS["selfTest"] and pool["nodes"] == POOL_STATUS["nodes"]
    assert pool["leased_replicas"] == 0

    odd_cluster = _cluster(repo, synthetic, ODD["run"], ODD["fleet"], ODD["pool"])
    odd = {path: body async for path, body in _answers(_app(odd_cluster))}
    (row,) = odd["/api/runs"]["runs"]
    assert (row["phase"], row["step"], row["policy_version"]) == ("Pending", 3, "v2")
    assert odd[base]["validation"] is None, "its canary record is unreadable, and the store holds none"
    assert odd[base]["status"]["phase"] == "Paused", "the status itself is shown as it is"
    fleet = odd[f"{base}/fleet"]
    assert fleet["name"] == "tiny-local-fleet", "an unreadable fleetName: the run's own fleet"
    assert fleet["ready_replicas"] == 0 and [r["name"] for r in fleet["replicas"]] == [
        "tiny-local-fleet-0"
    ], "an endpoint without its required fields is left out; the fleet's pod is still shown"
    assert odd[f"{base}/sandboxes"]["pool"]["self_test"] == {}
