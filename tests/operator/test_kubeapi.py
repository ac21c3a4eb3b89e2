"""The Kubernetes API mock in tests/support/kubeapi.py, alone and with a real kopf operator running against
it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import kopf
import pytest

from tests.support.kubeapi import MockApi, run_operator

FLEETS = ("legorl.dev/v1alpha1", "rolloutfleets")
FIELD_MANAGER = {"fieldManager": "legorl-test", "force": "true"}
APPLY = {"Content-Type": "application/apply-patch+yaml"}
MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


@pytest.fixture
def mock() -> Iterator[MockApi]:
    with MockApi() as api:
        yield api


def fleet(name: str, replicas: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"replicas": replicas},
    }


def configmap(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}}


def child_of(name: str, namespace: str, uid: str, replicas: int) -> dict[str, Any]:
    owner = {"apiVersion": "legorl.dev/v1alpha1", "kind": "RolloutFleet", "name": name, "uid": uid}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{name}-child",
            "namespace": namespace,
            "labels": {"legorl.dev/fleet": name, "app.kubernetes.io/managed-by": "legorl"},
            "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}],
        },
        "data": {"replicas": str(replicas)},
    }


def make_registry(calls: list[tuple[str, str]]) -> kopf.OperatorRegistry:
    """A tiny operator: the child ConfigMap via server-side apply, status via kopf and via /status."""
    registry = kopf.OperatorRegistry()

    async def apply_child(api: str, name: str, namespace: str, uid: str, replicas: int) -> None:
        async with httpx.AsyncClient(base_url=api) as client:
            response = await client.patch(
                f"/api/v1/namespaces/{namespace}/configmaps/{name}-child",
                params=FIELD_MANAGER,
                content=json.dumps(child_of(name, namespace, uid, replicas)),
                headers=APPLY,
            )
            response.raise_for_status()

    @kopf.on.create(*FLEETS, registry=registry, backoff=0.2)
    async def created(
        *,
        name: str,
        namespace: str | None,
        uid: str,
        spec: kopf.Spec,
        body: kopf.Body,
        patch: kopf.Patch,
        memo: Any,
        **_: Any,
    ) -> None:
        assert namespace is not None
        calls.append(("create", name))
        await apply_child(memo.api_url, name, namespace, uid, spec["replicas"])
        patch.status["phase"] = "Ready"
        kopf.info(body, reason="Ready", message=f"Fleet {name} is ready.")  # loggers do not post Events

    @kopf.on.update(*FLEETS, registry=registry, backoff=0.2)
    async def updated(
        *, name: str, namespace: str | None, uid: str, spec: kopf.Spec, meta: kopf.Meta, memo: Any, **_: Any
    ) -> None:
        assert namespace is not None
        calls.append(("update", name))
        await apply_child(memo.api_url, name, namespace, uid, spec["replicas"])
        async with httpx.AsyncClient(base_url=memo.api_url) as client:
            response = await client.patch(
                f"/apis/legorl.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/{name}/status",
                content=json.dumps({"status": {"observedGeneration": meta["generation"]}}),
                headers=MERGE,
            )
            response.raise_for_status()

    @kopf.on.resume(*FLEETS, registry=registry, backoff=0.2)
    def resumed(name: str, **_: Any) -> None:
        calls.append(("resume", name))

    @kopf.on.delete(*FLEETS, registry=registry, backoff=0.2)
    def deleted(name: str, **_: Any) -> None:
        calls.append(("delete", name))

    return registry


# --- the mock alone -------------------------------------------------------------------------------------


def test_discovery_declares_the_resources_and_lws_only_when_installed() -> None:
    with MockApi() as plain, MockApi(lws=True) as with_lws:
        for api, lws_status in ((plain, 404), (with_lws, 200)):
            with httpx.Client(base_url=api.url) as client:
                assert client.get("/apis/leaderworkerset.x-k8s.io/v1").status_code == lws_status
                core = {r["name"] for r in client.get("/api/v1").json()["resources"]}
                assert {"namespaces", "events", "pods", "configmaps", "secrets", "nodes"} <= core
                legorl = client.get("/apis/legorl.dev/v1alpha1").json()["resources"]
                names = {r["name"] for r in legorl}
                assert {"rlruns", "rolloutfleets", "rolloutfleets/status", "sandboxpools/scale"} <= names
                assert client.get("/api/v1/namespaces/default").json()["status"]["phase"] == "Active"
        crd = (
            "apiextensions.k8s.io/v1",
            "customresourcedefinitions",
            None,
            "leaderworkersets.leaderworkerset.x-k8s.io",
        )
        assert with_lws.get(*crd) is not None
        assert plain.get(*crd) is None


def test_writes_bump_versions_and_keep_status_and_spec_apart(mock: MockApi) -> None:
    created = mock.create({**fleet("f"), "status": {"phase": "ignored"}})
    assert created["metadata"]["generation"] == 1
    assert created["metadata"]["uid"] and created["metadata"]["creationTimestamp"]
    assert "status" not in created  # status is a subresource: ignored on create
    path = "/apis/legorl.dev/v1alpha1/namespaces/default/rolloutfleets/f"
    with httpx.Client(base_url=mock.url) as client:
        both = {"status": {"phase": "Ready"}, "spec": {"replicas": 9}}
        status = client.patch(f"{path}/status", json=both, headers=MERGE)
        assert status.status_code == 200
        assert status.json()["spec"] == {"replicas": 1} and status.json()["status"] == {"phase": "Ready"}
        assert status.json()["metadata"]["generation"] == 1
        main = client.patch(path, json={"spec": {"replicas": 3}, "status": {"phase": "x"}}, headers=MERGE)
        assert main.json()["metadata"]["generation"] == 2 and main.json()["status"] == {"phase": "Ready"}
        labels = client.patch(path, json={"metadata": {"labels": {"a": "b"}}}, headers=MERGE).json()
        assert labels["metadata"]["generation"] == 2
        assert int(labels["metadata"]["resourceVersion"]) > int(main.json()["metadata"]["resourceVersion"])
        stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"}]
        assert client.patch(path, json=stale, headers=JSON_PATCH).status_code == 422
        bad_label = client.patch(path, json={"metadata": {"labels": {"a": "-bad-"}}}, headers=MERGE)
        assert bad_label.status_code == 422
        scaled = client.patch(f"{path}/scale", json={"spec": {"replicas": 7}}, headers=MERGE)
        assert scaled.json()["spec"]["replicas"] == 7
    assert mock.fetch(*FLEETS, "default", "f")["spec"]["replicas"] == 7


def test_finalizers_hold_a_deleted_object_until_removed(mock: MockApi) -> None:
    mock.create({**fleet("f"), "metadata": {"name": "f", "finalizers": ["legorl.dev/test"]}})
    deleting = mock.delete(*FLEETS, "default", "f")
    assert deleting["metadata"]["deletionTimestamp"]
    assert mock.get(*FLEETS, "default", "f") is not None
    mock.patch(*FLEETS, "default", "f", {"metadata": {"finalizers": None}})
    assert mock.get(*FLEETS, "default", "f") is None
    assert mock.history(*FLEETS, "default", "f")[-1] is None


def test_server_side_apply_creates_then_merges_and_selectors_filter(mock: MockApi) -> None:
    mock.create(configmap("decoy", {"app": "x"}))
    with httpx.Client(base_url=mock.url) as client:
        path = "/api/v1/namespaces/default/configmaps/cm"
        body = configmap("cm", {"app": "x", "tier": "web"})
        created = client.patch(path, params=FIELD_MANAGER, content=json.dumps(body), headers=APPLY)
        assert created.status_code == 200
        again = {**body, "data": {"k": "v"}}
        applied = client.patch(path, params=FIELD_MANAGER, content=json.dumps(again), headers=APPLY).json()
        assert applied["data"] == {"k": "v"} and applied["metadata"]["labels"]["tier"] == "web"
        no_manager = client.patch(path, content=json.dumps(body), headers=APPLY)
        assert no_manager.status_code == 400

        def names(selector: str) -> list[str]:
            items = client.get("/api/v1/configmaps", params={"labelSelector": selector}).json()["items"]
            return sorted(item["metadata"]["name"] for item in items)

        assert names("app=x") == ["cm", "decoy"]
        assert names("app=x,tier=web") == ["cm"]
        assert names("app==x,tier!=web") == ["decoy"]
        assert names("tier") == ["cm"]
        assert names("!tier") == ["decoy"]
        assert names("tier in (db,web)") == ["cm"]


def test_watch_resumes_from_a_resource_version(mock: MockApi) -> None:
    with httpx.Client(base_url=mock.url) as client:
        listed = client.get("/apis/legorl.dev/v1alpha1/rolloutfleets").json()
        since = listed["metadata"]["resourceVersion"]
        mock.create(fleet("a"))
        mock.set_status(*FLEETS, "default", "a", {"phase": "Ready"})
        params = {"watch": "true", "resourceVersion": since, "timeoutSeconds": "1"}
        with client.stream("GET", "/apis/legorl.dev/v1alpha1/rolloutfleets", params=params) as stream:
            events = [json.loads(line) for line in stream.iter_lines() if line]
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]
    assert events[-1]["object"]["status"] == {"phase": "Ready"}
    assert mock.request_counts()["WATCH"] == 1
    assert mock.request_count == 1  # the list; the watch stream is counted apart


def test_garbage_collection_happens_only_when_asked(mock: MockApi) -> None:
    owner = mock.create(fleet("f"))
    mock.create(child_of("f", "default", owner["metadata"]["uid"], 1))
    mock.delete(*FLEETS, "default", "f")
    assert mock.get("v1", "configmaps", "default", "f-child") is not None
    assert mock.collect_garbage() == [("v1", "configmaps", "default", "f-child")]
    assert mock.get("v1", "configmaps", "default", "f-child") is None


# --- a real kopf operator against the mock --------------------------------------------------------------


def test_kopf_operator_handles_a_fleet_end_to_end(mock: MockApi) -> None:
    calls: list[tuple[str, str]] = []
    memo = kopf.Memo(api_url=mock.url)
    with run_operator(mock, make_registry(calls), memo=memo) as operator:
        mock.reset_requests()
        mock.create(fleet("fleet-a", replicas=2))

        def ready() -> dict[str, Any] | None:
            obj = mock.get(*FLEETS, "default", "fleet-a")
            return obj if obj and obj.get("status", {}).get("phase") == "Ready" else None

        obj = operator.wait_for(ready, what="fleet-a to be Ready")
        child = operator.wait_for(lambda: mock.get("v1", "configmaps", "default", "fleet-a-child"))
        assert child["data"] == {"replicas": "2"}
        assert child["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        counts = mock.request_counts()
        assert counts.get("PATCH", 0) >= 2  # at least the child's apply and kopf's status/annotations
        assert mock.request_count == sum(n for verb, n in counts.items() if verb != "WATCH")

        # kopf's bookkeeping lives in annotations under legorl.dev, never in .status.kopf.
        annotations = obj["metadata"].get("annotations", {})
        assert "legorl.dev/last-handled-configuration" in annotations
        assert "kopf" not in obj.get("status", {})
        assert not any(key.startswith("kopf.zalando.org/") for key in annotations)
        assert obj["metadata"].get("finalizers")  # because of the delete handler

        # The handler's kopf.info() goes to the mock as a v1 Event about the fleet.
        events = operator.wait_for(lambda: mock.events("default", involved_name="fleet-a"))
        assert [(e["reason"], e["message"], e["type"]) for e in events] == [
            ("Ready", "Fleet fleet-a is ready.", "Normal")
        ]
        assert events[0]["involvedObject"]["uid"] == obj["metadata"]["uid"]

        # An update of the spec bumps the generation and runs the update handler.
        mock.patch(*FLEETS, "default", "fleet-a", {"spec": {"replicas": 3}})
        observed = operator.wait_for(
            lambda: mock.fetch(*FLEETS, "default", "fleet-a")["status"]["observedGeneration"]
        )
        assert observed == 2
        operator.wait_for(
            lambda: mock.fetch("v1", "configmaps", "default", "fleet-a-child")["data"]["replicas"] == "3"
        )
        assert ("update", "fleet-a") in calls

        # The operator's own listing with a label selector gets only its children.
        mock.create(configmap("decoy", {"legorl.dev/fleet": "other"}))
        with httpx.Client(base_url=mock.url) as client:
            selector = "legorl.dev/fleet=fleet-a,app.kubernetes.io/managed-by=legorl"
            listed = client.get("/api/v1/namespaces/default/configmaps", params={"labelSelector": selector})
        assert [item["metadata"]["name"] for item in listed.json()["items"]] == ["fleet-a-child"]

        # Deletion: kopf's finalizer holds the object until the delete handler ran; the child stays
        # until the test plays the garbage collector.
        mock.delete(*FLEETS, "default", "fleet-a")
        operator.wait_for(lambda: mock.get(*FLEETS, "default", "fleet-a") is None, what="fleet-a to go")
        assert ("delete", "fleet-a") in calls
        assert mock.get("v1", "configmaps", "default", "fleet-a-child") is not None
        assert ("v1", "configmaps", "default", "fleet-a-child") in mock.collect_garbage()
        assert mock.get("v1", "configmaps", "default", "fleet-a-child") is None
    assert calls.count(("create", "fleet-a")) == 1


def test_kopf_operator_restart_resumes_without_recreating(mock: MockApi) -> None:
    calls: list[tuple[str, str]] = []
    registry = make_registry(calls)
    memo = kopf.Memo(api_url=mock.url)
    with run_operator(mock, registry, memo=memo) as operator:
        mock.create(fleet("fleet-b"))
        operator.wait_for(lambda: mock.get("v1", "configmaps", "default", "fleet-b-child"))
        operator.wait_for(
            lambda: (
                "legorl.dev/last-handled-configuration"
                in (mock.get(*FLEETS, "default", "fleet-b") or {})["metadata"].get("annotations", {})
            )
        )
    assert operator.thread.is_alive() is False
    started = threading.Event()
    with run_operator(mock, registry, memo=memo, startup=lambda settings, memo: started.set()) as operator:
        assert started.is_set()
        operator.wait_for(lambda: ("resume", "fleet-b") in calls, what="the resume handler")
    assert calls.count(("create", "fleet-b")) == 1
    assert ("update", "fleet-b") not in calls


def test_kopf_failures_are_retried_and_surfaced(mock: MockApi) -> None:
    calls: list[tuple[str, str]] = []
    mock.inject_error("PATCH", "configmaps", status=500)  # the first apply of the child fails
    with (
        pytest.raises(AssertionError, match="kopf logged errors"),
        run_operator(mock, make_registry(calls), memo=kopf.Memo(api_url=mock.url)) as operator,
    ):
        operator.wait_for(lambda: mock.watch_count(*FLEETS), what="kopf to watch the fleets")
        mock.create(fleet("fleet-c"))
        operator.wait_for(lambda: mock.get("v1", "configmaps", "default", "fleet-c-child"))
    assert calls.count(("create", "fleet-c")) == 2  # failed once, retried after the handler's backoff
    assert any("500" in message for message in operator.errors)


def test_a_mock_that_keeps_no_requests_still_answers_them() -> None:
    """Benchmarks run with record_requests=False so long runs do not keep every request."""
    import httpx  # noqa: PLC0415

    with MockApi(record_requests=False) as mock, httpx.Client(base_url=mock.url) as http:
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
        for _ in range(3):
            http.post("/api/v1/namespaces/default/configmaps", json=body)
            got = http.get("/api/v1/namespaces/default/configmaps/c")
            assert got.status_code == 200, got.text
            assert got.json()["data"] == {"k": "v"}
        assert http.get("/api/v1/namespaces").status_code == 200
        assert len(mock.emulator._requests) == 0
        assert mock.request_count == 7
