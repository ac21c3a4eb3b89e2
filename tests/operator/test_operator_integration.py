"""The real operator (kopf, our registry, our reconciler) against the Kubernetes API mock.

The mock (tests/support/kubeapi.py) is kmock plus glue. What it cannot show, and where that is tested instead:
- garbage collection: deletion cascades only when a test calls `collect_garbage()`; the owner references
  that make a real cluster cascade are pinned by the golden render tests;
- workload controllers and the kubelet: nothing creates pods or fills in Deployment/DaemonSet/Job status;
  tests play those parts with `set_status()` and `create()`, shaped as the real ones write them;
- schema validation, defaulting and CEL enforcement (tests/api/test_cel.py, test_invalid_manifests.py) and
  server-side apply field ownership and conflicts (opt-in real-cluster suite);
- NetworkPolicy enforcement, RBAC, admission (opt-in real-cluster suite).
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from legorl.api.labels import POLICY_VERSION_ANNOTATION
from legorl.operator.handlers import build_registry
from legorl.operator.main import kopf_settings, make_reconciler
from legorl.operator.reconcile import Reconciler
from legorl.operator.settings import OperatorSettings
from legorl.proxy.testing import FakeEngine
from tests.support.asgi_server import serve
from tests.support.kubeapi import MockApi, OperatorHandle, mock_timeouts, run_operator

REPO = Path(__file__).resolve().parents[2]
GV = "legorl.dev/v1alpha1"
NS = "default"
TIMEOUT = 15.0


def manifests(name: str) -> list[dict[str, Any]]:
    """An example's documents, placed in the test namespace."""
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / name).read_text()) if d]
    for doc in docs:
        doc["metadata"]["namespace"] = NS
    return docs


def operator_test_settings(**overrides: Any) -> OperatorSettings:
    base = OperatorSettings(
        debounce_seconds=0.05,
        resync_seconds=300.0,
        watch_timeout_seconds=5,
        settle_seconds=0.3,
        # The played engine pods have made-up addresses (10.0.0.x): nothing may dial them off this machine.
        # test_the_fleet_reports_the_version_its_engines_serve turns it on with an engine on loopback.
        engine_version_seconds=0,
    )
    return replace(base, **overrides)


def kopf_test_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    """The production kopf settings, with the mock-friendly timeouts of tests/support/kubeapi.py."""
    return mock_timeouts(kopf_settings(settings))


class Env:
    """A running mock plus a running operator, and shortcuts to read what they did."""

    def __init__(self, mock: MockApi, handle: OperatorHandle, close: Any) -> None:
        self.mock = mock
        self.handle = handle
        self._close = close
        self.closed = False

    def close(self) -> None:
        """Stop this operator (the mock keeps running)."""
        if not self.closed:
            self.closed = True
            self._close()

    @property
    def reconciler(self) -> Reconciler:
        reconciler = self.handle.memo["reconciler"]
        assert isinstance(reconciler, Reconciler)
        return reconciler

    def get(self, plural: str, name: str, api_version: str = GV) -> dict[str, Any]:
        return self.mock.fetch(api_version, plural, NS, name)

    def condition(self, plural: str, name: str, type_: str) -> dict[str, Any]:
        status = self.get(plural, name).get("status") or {}
        for cond in status.get("conditions", []):
            if cond["type"] == type_:
                return dict(cond)
        raise KeyError(f"no {type_} condition yet")

    def wait_condition(
        self,
        plural: str,
        name: str,
        type_: str,
        status: str,
        reason: str | None = None,
        *,
        contains: str = "",
    ) -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            cond = self.condition(plural, name, type_)
            good = cond["status"] == status and (reason is None or cond["reason"] == reason)
            return cond if good and contains in cond["message"] else None

        return self.handle.wait_for(
            ok, timeout=TIMEOUT, what=f"{plural}/{name} {type_}={status} {reason or ''}"
        )

    def wait_children(self, owner: str, count: int) -> dict[tuple[str, str], dict[str, Any]]:
        """Wait until exactly `count` children of `owner` exist; return them."""

        def ready() -> dict[tuple[str, str], dict[str, Any]] | None:
            found = self.children(owner)
            return found if len(found) == count else None

        return self.handle.wait_for(ready, timeout=TIMEOUT, what=f"{count} children of {owner}")

    def children(self, owner: str) -> dict[tuple[str, str], dict[str, Any]]:
        """Every stored object carrying `legorl.dev/owner: <owner>`, by (kind, name)."""
        out = {}
        for api_version, plural in KINDS_TO_SCAN:
            for obj in self.mock.objects(api_version, plural, NS):
                if (obj["metadata"].get("labels") or {}).get("legorl.dev/owner") == owner:
                    out[(obj["kind"], obj["metadata"]["name"])] = obj
        return out


KINDS_TO_SCAN = [
    ("v1", "serviceaccounts"),
    ("v1", "services"),
    ("apps/v1", "deployments"),
    ("apps/v1", "statefulsets"),
    ("apps/v1", "daemonsets"),
    ("batch/v1", "jobs"),
    ("policy/v1", "poddisruptionbudgets"),
    ("networking.k8s.io/v1", "networkpolicies"),
    (GV, "rolloutfleets"),
    (GV, "sandboxpools"),
]


@pytest.fixture
def env_factory() -> Iterator[Any]:
    """Start a mock and an operator; several operators may run against one mock in turn."""
    stack: list[Any] = []

    def start(
        mock: MockApi | None = None,
        settings: OperatorSettings | None = None,
        fail_on_errors: bool = True,
        **mock_args: Any,
    ) -> Env:
        if mock is None:
            mock = MockApi(**mock_args)
            mock.start()
            stack.append(mock.stop)
        settings = settings or operator_test_settings()
        url = mock.url
        registry = build_registry(login=lambda **_: kopf.ConnectionInfo(server=url))
        ctx = run_operator(
            mock,
            registry,
            memo=kopf.Memo(reconciler=make_reconciler(settings)),
            settings=kopf_test_settings(settings),
            fail_on_errors=fail_on_errors,
        )
        handle = ctx.__enter__()
        env = Env(mock, handle, lambda: ctx.__exit__(None, None, None))
        stack.append(env.close)
        return env

    yield start
    while stack:
        stack.pop()()


# --- the kubelet and controllers the mock lacks -------------------------------------------------------


def ready_deployment(mock: MockApi, name: str, replicas: int) -> None:
    obj = mock.fetch("apps/v1", "deployments", NS, name)
    mock.set_status(
        "apps/v1",
        "deployments",
        NS,
        name,
        {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
            "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}],
        },
    )


def engine_pod(
    mock: MockApi,
    deployment: str,
    index: int,
    *,
    ready: bool,
    version: str | None = None,
    ip: str | None = None,
) -> None:
    template = mock.fetch("apps/v1", "deployments", NS, deployment)["spec"]["template"]
    name = f"{deployment}-7d9c-{index}"
    annotations = {POLICY_VERSION_ANNOTATION: version} if version else {}
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": template["metadata"]["labels"],
            "annotations": annotations,
        },
        "spec": copy.deepcopy(template["spec"]) | {"nodeName": f"gpu-node-{index}"},
    }
    if mock.get("v1", "pods", NS, name) is None:
        mock.create(body)
    else:
        mock.patch("v1", "pods", NS, name, {"metadata": {"annotations": annotations}})
    mock.set_status(
        "v1",
        "pods",
        NS,
        name,
        {
            "phase": "Running",
            "podIP": ip or f"10.0.0.{10 + index}",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [
                {"name": "vllm", "image": "vllm", "ready": ready, "restartCount": 0, "state": {"running": {}}}
            ],
        },
    )


def ready_pool(mock: MockApi, pool: str, nodes: list[str]) -> None:
    """Each pre-pull DaemonSet runs on every node with all its images pulled."""
    for ds in mock.objects("apps/v1", "daemonsets", NS):
        if ds["metadata"]["labels"].get("legorl.dev/owner") != f"sandboxpool.{pool}":
            continue
        mock.set_status(
            "apps/v1",
            "daemonsets",
            NS,
            ds["metadata"]["name"],
            {
                "observedGeneration": ds["metadata"]["generation"],
                "desiredNumberScheduled": len(nodes),
                "currentNumberScheduled": len(nodes),
                "numberReady": len(nodes),
            },
        )
        template = ds["spec"]["template"]
        for node in nodes:
            name = f"{ds['metadata']['name']}-{node}"
            mock.create(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": NS, "labels": template["metadata"]["labels"]},
                    "spec": copy.deepcopy(template["spec"]) | {"nodeName": node},
                }
            )
            inits = [
                {
                    "name": c["name"],
                    "image": c["image"],
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
                }
                for c in template["spec"]["initContainers"]
            ]
            mock.set_status(
                "v1",
                "pods",
                NS,
                name,
                {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "initContainerStatuses": inits,
                    "containerStatuses": [
                        {
                            "name": "pause",
                            "image": "pause",
                            "ready": True,
                            "restartCount": 0,
                            "state": {"running": {}},
                        }
                    ],
                },
            )


# --- printer columns, as kubectl computes them -------------------------------------------------------


def _jsonpath(obj: Any, path: str) -> Any:
    """The subset of kubectl's JSONPath our printer columns use: `.a.b` and `[?(@.k=="v")]`."""
    for part in re.findall(r"\.[A-Za-z0-9_]+|\[\?\(@\.\w+==\"[^\"]*\"\)\]", path):
        if part.startswith("."):
            obj = obj.get(part[1:]) if isinstance(obj, dict) else None
        else:
            key, value = re.match(r"\[\?\(@\.(\w+)==\"([^\"]*)\"\)\]", part).groups()  # type: ignore[union-attr]
            obj = next((o for o in obj or [] if o.get(key) == value), None)
        if obj is None:
            return None
    return obj


def columns(env: Env, plural: str, name: str) -> dict[str, Any]:
    """`kubectl get <plural> <name>` as a dict of column → value, from the CRD's printer columns."""
    crd = yaml.safe_load((REPO / f"crds/legorl.dev_{plural}.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    obj = env.get(plural, name)
    return {
        c["name"]: _jsonpath(obj, c["jsonPath"])
        for c in version["additionalPrinterColumns"]
        if not c.get("priority")
    }


# --- the tests ----------------------------------------------------------------------------------------


def test_fleet_becomes_ready_scales_and_explains_itself(env_factory: Any) -> None:
    env: Env = env_factory()
    fleet = manifests("shared-fleet-and-pool.yaml")[0]
    assert fleet["kind"] == "RolloutFleet"
    env.mock.create(fleet)
    owner = "rolloutfleet.coder-fleet"
    children = env.wait_children(owner, 6)
    assert set(children) == {
        ("ServiceAccount", "coder-fleet-engine"),
        ("Deployment", "coder-fleet-engine"),
        ("Service", "coder-fleet-engine"),
        ("Service", "coder-fleet-engine-replicas"),
        ("PodDisruptionBudget", "coder-fleet-engine"),
        ("NetworkPolicy", "coder-fleet-engine"),
    }
    uid = env.get("rolloutfleets", "coder-fleet")["metadata"]["uid"]
    for child in children.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "RolloutFleet",
            "coder-fleet",
            uid,
            True,
        )

    # Nothing runs yet: the status and `kubectl get` say so and why.
    ready = env.wait_condition("rolloutfleets", "coder-fleet", "Ready", "False", "ReplicasNotReady")
    assert "0/2 replicas ready" in ready["message"]
    assert columns(env, "rolloutfleets", "coder-fleet")["Reason"] == "ReplicasNotReady"

    # The Deployment controller and kubelet do their part: two replicas up, one still loading.
    ready_deployment(env.mock, "coder-fleet-engine", 2)
    engine_pod(env.mock, "coder-fleet-engine", 0, ready=True)
    engine_pod(env.mock, "coder-fleet-engine", 1, ready=False)
    loading = env.wait_condition("rolloutfleets", "coder-fleet", "Ready", "False", "ModelLoading")
    assert "1/2 replicas ready" in loading["message"]
    engine_pod(env.mock, "coder-fleet-engine", 1, ready=True, version="0")
    env.wait_condition("rolloutfleets", "coder-fleet", "Ready", "True", "AllReplicasReady")
    status = env.get("rolloutfleets", "coder-fleet")["status"]
    assert status["readyReplicas"] == 2
    assert status["servedPolicyVersion"] == "0"
    assert sorted(e["url"] for e in status["endpoints"]) == [
        "http://10.0.0.10:8000/v1",
        "http://10.0.0.11:8000/v1",
    ]
    assert status["selector"] == "legorl.dev/component=engine,legorl.dev/owner=rolloutfleet.coder-fleet"
    assert status["observedGeneration"] == env.get("rolloutfleets", "coder-fleet")["metadata"]["generation"]
    cols = columns(env, "rolloutfleets", "coder-fleet")
    assert (cols["Ready"], cols["Reason"], cols["Replicas"], cols["Available"], cols["Policy"]) == (
        "True",
        "AllReplicasReady",
        2,
        2,
        "0",
    )

    # `kubectl scale rolloutfleet coder-fleet --replicas=3` (the scale subresource writes spec.replicas).
    env.mock.patch(GV, "rolloutfleets", NS, "coder-fleet", {"spec": {"replicas": 3}})
    env.handle.wait_for(
        lambda: env.get("deployments", "coder-fleet-engine", "apps/v1")["spec"]["replicas"] == 3,
        timeout=TIMEOUT,
    )
    env.wait_condition("rolloutfleets", "coder-fleet", "Ready", "False", "ReplicasNotReady")

    # kopf's bookkeeping is in annotations, never in .status; our events tell the story.
    body = env.get("rolloutfleets", "coder-fleet")
    assert "kopf" not in body["status"]
    assert any(k.startswith("legorl.dev/last-handled-configuration") for k in body["metadata"]["annotations"])

    def reasons() -> set[tuple[str, str]]:
        return {(e["type"], e["reason"]) for e in env.mock.events(NS, involved_name="coder-fleet")}

    env.handle.wait_for(
        lambda: {("Normal", "AllReplicasReady"), ("Warning", "ReplicasNotReady")} <= reasons()
    )


def test_the_fleet_reports_the_version_its_engines_serve(env_factory: Any) -> None:
    """The trainer loads weights over HTTP and writes no Kubernetes object: the operator asks each serving
    replica (`GET /weight_info` of a real engine double on loopback, as the trainer's sync would leave it)
    and records the answer on the pod, so `kubectl get rolloutfleets` follows the syncs. On the old code
    the status kept whatever the pod was created with."""
    engine = FakeEngine()
    engine.version = "default"  # vLLM's name for the weights it started from: the run's checkpoint, v0
    with serve(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        env: Env = env_factory(settings=operator_test_settings(engine_version_seconds=0.2))
        fleet = manifests("shared-fleet-and-pool.yaml")[0]
        fleet["spec"]["replicas"], fleet["spec"]["port"] = 1, port
        env.mock.create(fleet)
        env.wait_children("rolloutfleet.coder-fleet", 6)
        ready_deployment(env.mock, "coder-fleet-engine", 1)
        engine_pod(env.mock, "coder-fleet-engine", 0, ready=True, ip="127.0.0.1")
        pod = "coder-fleet-engine-7d9c-0"

        def served(version: str) -> bool:
            status = env.get("rolloutfleets", "coder-fleet").get("status") or {}
            annotations = env.mock.fetch("v1", "pods", NS, pod)["metadata"].get("annotations") or {}
            return (
                status.get("servedPolicyVersion") == version
                and annotations.get(POLICY_VERSION_ANNOTATION) == version
                and columns(env, "rolloutfleets", "coder-fleet")["Policy"] == version
            )

        env.handle.wait_for(lambda: served("v0"), timeout=TIMEOUT, what="v0 served, from /weight_info")
        engine.version = "v2"  # a weight sync: no pod, Deployment or fleet changes
        env.handle.wait_for(lambda: served("v2"), timeout=TIMEOUT, what="v2 served, from /weight_info")


def test_fleet_spec_update_rolls_the_engine_and_a_crash_loop_degrades(env_factory: Any) -> None:
    env: Env = env_factory()
    fleet = manifests("shared-fleet-and-pool.yaml")[0]
    env.mock.create(fleet)
    deploy = env.handle.wait_for(
        lambda: env.get("deployments", "coder-fleet-engine", "apps/v1"), timeout=TIMEOUT
    )
    assert "--dtype" in (args := deploy["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[args.index("--dtype") + 1] == "bfloat16"
    env.mock.patch(GV, "rolloutfleets", NS, "coder-fleet", {"spec": {"settings": {"maxModelLen": 65536}}})

    def rolled() -> bool:
        args = env.get("deployments", "coder-fleet-engine", "apps/v1")["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        return "--max-model-len" in args and args[args.index("--max-model-len") + 1] == "65536"

    env.handle.wait_for(rolled, timeout=TIMEOUT)
    # A replica crash-loops: Degraded says which container, how often, and how it last exited.
    env.mock.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "coder-fleet-engine-x1",
                "namespace": NS,
                "labels": env.get("deployments", "coder-fleet-engine", "apps/v1")["spec"]["template"][
                    "metadata"
                ]["labels"],
            },
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        }
    )
    env.mock.set_status(
        "v1",
        "pods",
        NS,
        "coder-fleet-engine-x1",
        {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "vllm",
                    "image": "vllm",
                    "ready": False,
                    "restartCount": 6,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2m40s"}},
                    "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                }
            ],
        },
    )
    degraded = env.wait_condition("rolloutfleets", "coder-fleet", "Degraded", "True", "CrashLoop")
    assert "CrashLoopBackOff after 6 restarts" in degraded["message"]
    assert "OOMKilled (137)" in degraded["message"]
    warnings = env.handle.wait_for(
        lambda: [e for e in env.mock.events(NS, involved_name="coder-fleet") if e["reason"] == "CrashLoop"]
    )
    assert warnings[0]["type"] == "Warning"


def test_pool_prepulls_in_chunks_and_reports_each_node(env_factory: Any) -> None:
    env: Env = env_factory()
    pool = manifests("shared-fleet-and-pool.yaml")[1]
    pool["spec"]["prePull"] = {"policy": "All", "imagesPerDaemonSet": 1}
    images = pool["spec"]["source"]["images"]
    env.mock.create(pool)
    owner = "sandboxpool.python-repos"

    def daemon_sets() -> list[dict[str, Any]]:
        found = [o for (k, _), o in env.children(owner).items() if k == "DaemonSet"]
        return found if len(found) == len(images) else []

    dss = env.handle.wait_for(daemon_sets, timeout=TIMEOUT)
    pulled = sorted(c["image"] for ds in dss for c in ds["spec"]["template"]["spec"]["initContainers"])
    assert pulled == sorted(images)
    env.wait_condition("sandboxpools", "python-repos", "ImagesCached", "False", "PullInProgress")
    ready_pool(env.mock, "python-repos", ["node-a", "node-b"])
    cached = env.wait_condition("sandboxpools", "python-repos", "ImagesCached", "True", "AllImagesCached")
    assert f"{len(images)} image(s) on all 2 matching node(s)" in cached["message"]
    env.wait_condition("sandboxpools", "python-repos", "Ready", "True", "PoolReady")
    status = env.get("sandboxpools", "python-repos")["status"]
    assert [(n["name"], n["desired"], n["pulled"], n["failed"]) for n in status["nodes"]] == [
        ("node-a", len(images), len(images), 0),
        ("node-b", len(images), len(images), 0),
    ]
    assert status["podTemplateHash"]
    env.wait_condition("sandboxpools", "python-repos", "DefensesVerified", "Unknown", "SelfTestPending")
    cols = columns(env, "sandboxpools", "python-repos")
    assert (cols["Ready"], cols["Images"], cols["Cached"]) == ("True", len(images), len(images))

    # Fewer images later: the surplus chunk is deleted.
    env.mock.patch(GV, "sandboxpools", NS, "python-repos", {"spec": {"source": {"images": images[:1]}}})
    env.handle.wait_for(
        lambda: len([k for k in env.children(owner) if k[0] == "DaemonSet"]) == 1, timeout=TIMEOUT
    )


def test_run_waits_for_its_fleet_and_pool_then_reports_the_missing_controller(env_factory: Any) -> None:
    env: Env = env_factory()
    fleet, pool, train, evaluate = manifests("shared-fleet-and-pool.yaml")
    env.mock.create(train)
    # The fleet and pool do not exist yet: the run says so and starts nothing.
    validated = env.wait_condition("rlruns", "coder-grpo", "Validated", "False", "ReferenceNotFound")
    assert "RolloutFleet 'coder-fleet' does not exist in namespace default" in validated["message"]
    assert env.get("rlruns", "coder-grpo")["status"]["phase"] == "Invalid"
    assert env.children("rlrun.coder-grpo") == {}

    # They appear: the run resolves them without being touched (their events wake it up).
    env.mock.create(fleet)
    env.mock.create(pool)
    env.mock.create(evaluate)
    env.wait_condition("rlruns", "coder-grpo", "Validated", "True", "Valid")
    kids = env.wait_children("rlrun.coder-grpo", 5)
    assert set(kids) == {
        ("ServiceAccount", "coder-grpo-trainer"),
        ("Service", "coder-grpo-trainer"),
        ("Job", "coder-grpo-trainer"),
        ("NetworkPolicy", "coder-grpo-trainer"),
        ("NetworkPolicy", "coder-grpo-trials"),
    }
    job = kids[("Job", "coder-grpo-trainer")]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["suspend"] is False
    env.wait_condition(
        "rlruns",
        "coder-grpo",
        "RolloutReady",
        "False",
        "FleetNotReady",
        contains="RolloutFleet coder-fleet is not ready (ReplicasNotReady: 0/2 replicas ready",
    )
    cols = columns(env, "rlruns", "coder-grpo")
    assert (cols["Phase"], cols["Reason"]) == ("Pending", "FleetNotReady")

    ready_deployment(env.mock, "coder-fleet-engine", 2)
    engine_pod(env.mock, "coder-fleet-engine", 0, ready=True, version="7")
    engine_pod(env.mock, "coder-fleet-engine", 1, ready=True, version="7")
    ready_pool(env.mock, "python-repos", ["node-a"])
    training = env.wait_condition("rlruns", "coder-grpo", "Training", "False", "ControllerPending")
    assert "no run controller" in training["message"]
    status = env.get("rlruns", "coder-grpo")["status"]
    assert (status["phase"], status["reason"], status["policyVersion"]) == (
        "Pending",
        "ControllerPending",
        "7",
    )
    assert status["fleetName"] == "coder-fleet" and status["poolName"] == "python-repos"
    assert status["storeUri"] == "pvc://rl-store/coder-grpo/default/coder-grpo"
    assert columns(env, "rlruns", "coder-grpo")["Policy"] == "7"
    # The Evaluate run shares the fleet and pool but has no trainer.
    env.wait_condition("rlruns", "coder-benchmark", "Training", "False", "ControllerPending")
    assert [k for k in env.children("rlrun.coder-benchmark")] == [("NetworkPolicy", "coder-benchmark-trials")]


def test_failed_preflight_starts_nothing_and_a_fix_resumes(env_factory: Any) -> None:
    env: Env = env_factory()
    (run,) = manifests("tiny-local.yaml")
    env.mock.create(run)
    validated = env.wait_condition("rlruns", "tiny-local", "Validated", "False", "PreflightFailed")
    assert (
        "spec.policy.checkpoint.uri: 'builtin://tiny-swe': builtin:// models exist only in local runs"
        in (validated["message"])
    )
    assert "Nothing was started; fix the spec and re-apply" in validated["message"]
    time.sleep(0.5)
    assert env.children("rlrun.tiny-local") == {}
    env.handle.wait_for(
        lambda: [
            e for e in env.mock.events(NS, involved_name="tiny-local") if e["reason"] == "PreflightFailed"
        ]
    )
    failed = [e for e in env.mock.events(NS, involved_name="tiny-local") if e["reason"] == "PreflightFailed"]
    assert len(failed) == 1, failed  # posted once, when the condition changed
    (event,) = failed
    assert event["type"] == "Warning" and "builtin://" in event["message"]

    env.mock.patch(
        GV, "rlruns", NS, "tiny-local", {"spec": {"policy": {"checkpoint": {"uri": "hf://Qwen/Qwen3-0.6B"}}}}
    )
    env.wait_condition("rlruns", "tiny-local", "Validated", "True", "Valid")
    # The run's own fleet and pool are created, and the operator reconciles them in turn.
    env.handle.wait_for(lambda: env.get("deployments", "tiny-local-fleet-engine", "apps/v1"), timeout=TIMEOUT)
    owned = env.get("rolloutfleets", "tiny-local-fleet")
    assert owned["spec"]["model"]["uri"] == "hf://Qwen/Qwen3-0.6B"
    assert owned["metadata"]["ownerReferences"][0]["name"] == "tiny-local"
    env.handle.wait_for(lambda: env.get("networkpolicies", "tiny-local-pool-sandbox", "networking.k8s.io/v1"))


def test_suspend_scales_the_run_to_zero_and_resume_brings_it_back(env_factory: Any) -> None:
    env: Env = env_factory()
    (run,) = manifests("tiny-local.yaml")
    run["spec"]["policy"]["checkpoint"]["uri"] = "hf://Qwen/Qwen3-0.6B"
    env.mock.create(run)
    env.handle.wait_for(lambda: env.get("deployments", "tiny-local-fleet-engine", "apps/v1"), timeout=TIMEOUT)
    replicas = env.get("rolloutfleets", "tiny-local-fleet")["spec"]["replicas"]
    assert replicas >= 1
    env.mock.patch(GV, "rlruns", NS, "tiny-local", {"spec": {"suspend": True}})

    def suspended() -> bool:
        job = env.get("jobs", "tiny-local-trainer", "batch/v1")
        deploy = env.get("deployments", "tiny-local-fleet-engine", "apps/v1")
        return job["spec"]["suspend"] is True and deploy["spec"]["replicas"] == 0

    env.handle.wait_for(suspended, timeout=TIMEOUT)
    env.handle.wait_for(
        lambda: env.get("rlruns", "tiny-local")["status"]["phase"] == "Suspended", timeout=TIMEOUT
    )
    env.wait_condition("rolloutfleets", "tiny-local-fleet", "Ready", "False", "ScaledToZero")
    env.mock.patch(GV, "rlruns", NS, "tiny-local", {"spec": {"suspend": False}})

    def resumed() -> bool:
        job = env.get("jobs", "tiny-local-trainer", "batch/v1")
        deploy = env.get("deployments", "tiny-local-fleet-engine", "apps/v1")
        return job["spec"]["suspend"] is False and deploy["spec"]["replicas"] == replicas

    env.handle.wait_for(resumed, timeout=TIMEOUT)


def test_active_deadline_fails_the_run_and_releases_its_gpus(env_factory: Any) -> None:
    env: Env = env_factory()
    (run,) = manifests("tiny-local.yaml")
    run["spec"]["policy"]["checkpoint"]["uri"] = "hf://Qwen/Qwen3-0.6B"
    run["spec"]["activeDeadlineSeconds"] = 2
    env.mock.create(run)
    env.handle.wait_for(lambda: env.get("jobs", "tiny-local-trainer", "batch/v1"), timeout=TIMEOUT)
    failed = env.wait_condition("rlruns", "tiny-local", "Failed", "True", "DeadlineExceeded")
    assert "activeDeadlineSeconds (2s) passed" in failed["message"]
    status = env.get("rlruns", "tiny-local")["status"]
    assert status["phase"] == "Failed" and status["completionTime"]
    env.handle.wait_for(lambda: env.get("jobs", "tiny-local-trainer", "batch/v1")["spec"]["suspend"] is True)
    env.handle.wait_for(lambda: env.get("rolloutfleets", "tiny-local-fleet")["spec"]["replicas"] == 0)


def test_delete_cleans_up_through_owner_references(env_factory: Any) -> None:
    env: Env = env_factory()
    (run,) = manifests("tiny-local.yaml")
    run["spec"]["policy"]["checkpoint"]["uri"] = "hf://Qwen/Qwen3-0.6B"
    env.mock.create(run)
    env.handle.wait_for(lambda: env.get("deployments", "tiny-local-fleet-engine", "apps/v1"), timeout=TIMEOUT)
    # The run's trial egress policy is the last child it applies: the delete comes once it exists, so it does
    # not race the run's first reconcile.
    env.handle.wait_for(
        lambda: ("NetworkPolicy", "tiny-local-trials") in env.children("rlrun.tiny-local"), timeout=TIMEOUT
    )
    env.mock.delete(GV, "rlruns", NS, "tiny-local")
    # kopf's finalizer (the run-controller daemon's) is released promptly, so the run goes.
    env.handle.wait_for(lambda: env.mock.get(GV, "rlruns", NS, "tiny-local") is None, timeout=TIMEOUT)
    # The mock has no garbage collector: play its part, as the real one would — continuously, so an orphan a
    # reconcile still in flight creates after the owner went is collected too.
    removed: list[tuple[str, str, str | None, str]] = []

    def collected() -> bool:
        removed.extend(env.mock.collect_garbage())
        return all(not env.mock.objects(api_version, plural, NS) for api_version, plural in KINDS_TO_SCAN)

    env.handle.wait_for(collected, timeout=TIMEOUT)
    kinds = {plural for _, plural, _, _ in removed}
    assert {"rolloutfleets", "sandboxpools", "jobs", "deployments", "services"} <= kinds
    for api_version, plural in KINDS_TO_SCAN:
        assert env.mock.objects(api_version, plural, NS) == [], plural


def test_multi_node_fleet_uses_leader_worker_sets_when_installed(env_factory: Any) -> None:
    fleet = yaml.safe_load((REPO / "tests/golden/inputs/fleet-multinode.yaml").read_text())
    fleet["metadata"]["namespace"] = NS
    with_lws: Env = env_factory(lws=True)
    with_lws.mock.create(fleet)
    with_lws.handle.wait_for(
        lambda: with_lws.get("leaderworkersets", "big-fleet-engine", "leaderworkerset.x-k8s.io/v1"),
        timeout=TIMEOUT,
    )
    without: Env = env_factory()
    without.mock.create(fleet)
    # ServiceAccount, three Services (the serving one, the replicas' and the groups' headless ones), two
    # StatefulSet groups, PDB, NetworkPolicy.
    groups = without.wait_children("rolloutfleet.big-fleet", 8)
    assert sorted(name for kind, name in groups if kind == "StatefulSet") == [
        "big-fleet-engine-0",
        "big-fleet-engine-1",
    ]
    # Scaling in deletes the surplus group.
    without.mock.patch(GV, "rolloutfleets", NS, "big-fleet", {"spec": {"replicas": 1}})
    without.handle.wait_for(
        lambda: len(without.mock.objects("apps/v1", "statefulsets", NS)) == 1, timeout=TIMEOUT
    )


def test_restart_mid_reconcile_creates_no_duplicates(env_factory: Any) -> None:
    first: Env = env_factory(fail_on_errors=False)  # kopf logs the refused applies as errors
    mock = first.mock
    # The API server refuses every Service apply: the first operator gets only part-way.
    mock.inject_error("PATCH", "services", status=503, count=100_000)
    mock.create(manifests("shared-fleet-and-pool.yaml")[0])
    first.handle.wait_for(lambda: first.get("deployments", "coder-fleet-engine", "apps/v1"), timeout=TIMEOUT)
    time.sleep(0.5)
    assert mock.get("v1", "services", NS, "coder-fleet-engine") is None
    first.close()  # the operator goes away mid-reconcile (e.g. its pod is evicted)

    mock.clear_errors()
    before = {k: v["metadata"]["uid"] for k, v in first.children("rolloutfleet.coder-fleet").items()}
    second: Env = env_factory(mock=mock)
    kids = second.wait_children("rolloutfleet.coder-fleet", 6)
    # Exactly one of each child; what existed was kept (same uid), the missing Service was added.
    for key, uid in before.items():
        assert kids[key]["metadata"]["uid"] == uid, key
    assert ("Service", "coder-fleet-engine") in kids and ("Service", "coder-fleet-engine-replicas") in kids
    assert len(mock.objects("apps/v1", "deployments", NS)) == 1
    second.wait_condition("rolloutfleets", "coder-fleet", "Ready", "False", "ReplicasNotReady")


def test_transient_api_errors_are_retried(env_factory: Any) -> None:
    env: Env = env_factory(fail_on_errors=False)  # kopf logs the retried failures as errors
    env.mock.inject_error("PATCH", "deployments", status=500, count=2)
    env.mock.create(manifests("shared-fleet-and-pool.yaml")[0])
    env.handle.wait_for(lambda: env.get("deployments", "coder-fleet-engine", "apps/v1"), timeout=TIMEOUT)
    env.wait_condition("rolloutfleets", "coder-fleet", "Ready", "False", "ReplicasNotReady")


def test_children_the_api_server_refuses_are_reported_on_the_owner(env_factory: Any) -> None:
    env: Env = env_factory(fail_on_errors=False)  # the operator logs the refusal as an error too
    # E.g. an admission policy that forbids DaemonSets in this namespace.
    env.mock.inject_error("PATCH", "daemonsets", status=422, count=100_000)
    env.mock.create(manifests("shared-fleet-and-pool.yaml")[1])
    ready = env.wait_condition("sandboxpools", "python-repos", "Ready", "False", "InvalidSpec")
    assert ready["message"].startswith("the API server refused objects rendered from this spec: DaemonSet")
    # What the API server accepted was still applied.
    env.handle.wait_for(lambda: env.get("networkpolicies", "python-repos-sandbox", "networking.k8s.io/v1"))


def test_a_refused_trainer_job_invalidates_the_run(env_factory: Any) -> None:
    env: Env = env_factory(fail_on_errors=False)
    env.mock.inject_error("PATCH", "jobs", status=403, count=100_000)  # e.g. a quota or policy
    fleet, pool, train, _ = manifests("shared-fleet-and-pool.yaml")
    for doc in (fleet, pool, train):
        env.mock.create(doc)
    validated = env.wait_condition("rlruns", "coder-grpo", "Validated", "False", "InvalidSpec")
    assert "Job coder-grpo-trainer" in validated["message"]
    env.handle.wait_for(lambda: env.get("rlruns", "coder-grpo")["status"]["phase"] == "Invalid")


def test_trainer_job_template_is_never_changed_after_creation(env_factory: Any) -> None:
    """A Job's pod template is immutable: spec edits reach a running trainer only through
    suspend/parallelism, and the run stays valid (the API server would answer 422 otherwise)."""
    env: Env = env_factory()
    fleet, pool, train, _ = manifests("shared-fleet-and-pool.yaml")
    for doc in (fleet, pool, train):
        env.mock.create(doc)
    job = env.handle.wait_for(lambda: env.get("jobs", "coder-grpo-trainer", "batch/v1"), timeout=TIMEOUT)
    image = job["spec"]["template"]["spec"]["containers"][0]["image"]
    env.mock.patch(
        GV, "rlruns", NS, "coder-grpo", {"spec": {"trainer": {"image": {"image": "ghcr.io/x/t:2"}}}}
    )
    env.mock.patch(GV, "rlruns", NS, "coder-grpo", {"spec": {"suspend": True}})
    env.handle.wait_for(lambda: env.get("jobs", "coder-grpo-trainer", "batch/v1")["spec"]["suspend"] is True)
    job = env.get("jobs", "coder-grpo-trainer", "batch/v1")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == image
    env.wait_condition("rlruns", "coder-grpo", "Validated", "True", "Valid")


def test_an_object_deleted_mid_reconcile_is_not_an_error() -> None:
    """The cache still holds a fleet the API server has already deleted (garbage-collected with its
    owner, the watch not yet delivered): its status patch answers 404, and the reconcile ends quietly
    instead of failing (kopf would log an error and retry a reconcile of nothing)."""
    import asyncio  # noqa: PLC0415

    from legorl.operator.kube import Credentials, KubeClient  # noqa: PLC0415

    fleet = manifests("shared-fleet-and-pool.yaml")[0]
    with MockApi() as mock:
        stored = mock.create(fleet)
        mock.delete(
            "legorl.dev/v1alpha1", "rolloutfleets", stored["metadata"]["namespace"], fleet["metadata"]["name"]
        )
        reconciler = make_reconciler(operator_test_settings())
        key = ("RolloutFleet", stored["metadata"]["namespace"], fleet["metadata"]["name"])
        reconciler.store.objects[key] = stored

        async def reconcile() -> None:
            reconciler.client_ = KubeClient(Credentials(server=mock.url))
            try:
                await reconciler.reconcile(key)
            finally:
                await reconciler.client_.close()

        asyncio.run(reconcile())
        # It did try: the children were applied and the status patch was refused with 404.
        assert any(
            verb == "PATCH" and path.endswith(f"/rolloutfleets/{fleet['metadata']['name']}/status")
            for verb, path, _ in mock.request_log()
        )
