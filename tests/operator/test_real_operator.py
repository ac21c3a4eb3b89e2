"""The operator on a real kube-apiserver (v1.20.2), as the chart's ServiceAccount, under the chart's RBAC.

The chart is rendered with `helm template` (default values: cluster-wide) and applied, all but its
operator Deployment: there is no kubelet here, so this test runs that Deployment's container as a
process on this machine, with the Deployment's own arguments and environment and a kubeconfig that holds
the ServiceAccount's token (a real TokenRequest). Every request the operator makes is therefore
authenticated as `system:serviceaccount:legorl-system:<sa>` and authorized by the real RBAC
authorizer against the chart's ClusterRoles, with OwnerReferencesPermissionEnforcement on (the
admission plugin that checks a blocking owner reference against the owner's `finalizers`).

What this test plays: the scheduler (binds pods to nodes), the kubelet (registers a Ready node;
pod phases, readiness and loopback IPs where nothing listens) for the pods the real controller-manager
and the operator create, and the StatefulSet pod-index label 1.28 sets. The 1.20 server lacks
PodDisruptionBudget `policy/v1`, newer Job fields and native sidecars; the operator reaches it through
`tests/kube120.Downgrade`, which rewrites exactly those (and nothing else) in this suite only.

Least privilege is measured from the API server's audit log: after the lifecycles, every permission
the chart grants must have been used by some request of the operator
(`test_the_chart_grants_exactly_what_the_lifecycles_use`, but for `NOT_EXERCISED`), and none of the
operator's requests may have been refused, but while a restarted server had not yet loaded its roles
(`UNSYNCED`). The same holds for the rest of what the chart runs, each under its own ServiceAccount on
this server: the UI (`ui.enabled`, with an action token; `UI_NOT_EXERCISED`) and kopf's peering
(`operator.peering.enabled`, cluster-wide and namespaced; `PEERING_NOT_EXERCISED`). docs/operator.md's
`rbac-*` tables are these measurements.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from legorl.manifests import kubeyaml
from legorl.manifests.generated import to_yaml
from tests.support.kube120 import Downgrade
from tests.support.kubecluster import ControlPlane, control_plane, free_port, kube_bin

REPO = Path(__file__).resolve().parents[2]
RELEASE, RELEASE_NS = "demo", "legorl-system"
TIMEOUT = 90.0
RESYNC = 15
"""The operator's full-resync period here (the chart leaves its default, 5 minutes)."""
MANAGED = "app.kubernetes.io/managed-by=legorl-operator"
RUNSC = {"handler": "runsc"}
POD_INDEX = "apps.kubernetes.io/pod-index"

if kube_bin() is None:
    if os.environ.get("LEGORL_REQUIRE_KUBE") == "1":
        raise RuntimeError("LEGORL_REQUIRE_KUBE=1 but no kube-apiserver: run `bash scripts/get-kube.sh`")
    pytest.skip("no kube-apiserver built: run `bash scripts/get-kube.sh`", allow_module_level=True)

from tests.operator.test_real_apiserver import CRD_FILES, KOPF_CRDS, crd_for_120, example  # noqa: E402

# A real etcd and kube-apiserver, and the operator on it as the chart's ServiceAccount.
pytestmark = pytest.mark.slow

# --- the API as the test's admin, the scheduler and the kubelet -----------------------------------------


class Admin:
    """The cluster admin's plain REST client (the test's own requests; the operator has its own)."""

    def __init__(self, plane: ControlPlane) -> None:
        self.http = httpx.Client(
            base_url=plane.url,
            verify=ssl.create_default_context(cafile=str(plane.ca)),
            headers={"Authorization": f"Bearer {plane.admin_token}"},
            timeout=30,
        )

    def close(self) -> None:
        self.http.close()

    def get(self, path: str) -> dict[str, Any] | None:
        reply = self.http.get(path)
        if reply.status_code == 404:
            return None
        reply.raise_for_status()
        body: dict[str, Any] = reply.json()
        return body

    def items(self, path: str, selector: str = "") -> list[dict[str, Any]]:
        reply = self.http.get(path, params={"labelSelector": selector} if selector else None)
        reply.raise_for_status()
        items: list[dict[str, Any]] = reply.json()["items"]
        return items

    def send(
        self, method: str, path: str, body: Any, content_type: str = "application/json"
    ) -> httpx.Response:
        return self.http.request(
            method, path, content=json.dumps(body), headers={"Content-Type": content_type}
        )

    def merge(self, path: str, body: Any) -> None:
        self.send("PATCH", path, body, "application/merge-patch+json").raise_for_status()


@dataclass
class Kubelet:
    """Binds every pending operator-managed pod to a node and reports it Running and Ready, as a
    scheduler and a node's kubelet would; DaemonSet pods go to the node their affinity names."""

    admin: Admin
    node: str = "node-a"
    pending: set[str] = field(default_factory=set)
    """Components (`legorl.dev/component`) whose pods stay Pending once bound."""
    errors: list[BaseException] = field(default_factory=list)
    _ips: Iterator[int] = field(default_factory=lambda: itertools.count(10))
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Kubelet:
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def check(self) -> None:
        if self.errors:
            raise AssertionError("the test's kubelet failed") from self.errors[0]

    def _loop(self) -> None:
        while not self._stop.wait(0.3):
            try:
                for pod in self.admin.items("/api/v1/pods", MANAGED):
                    self._play(pod)
            except httpx.TransportError:
                continue  # the API server is restarting: a kubelet keeps trying
            except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread by check()
                self.errors.append(exc)
                return

    def _play(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        base = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        if meta.get("deletionTimestamp"):  # the kubelet confirms a graceful deletion once stopped
            if spec.get("nodeName"):
                self.admin.http.delete(base, params={"gracePeriodSeconds": "0"})
            return
        if (pod.get("status") or {}).get("phase") == "Running":
            return
        pending = meta.get("labels", {}).get("legorl.dev/component") in self.pending
        owners = {r["kind"] for r in meta.get("ownerReferences") or []}
        if "StatefulSet" in owners and POD_INDEX not in (meta.get("labels") or {}):
            # The label 1.28's StatefulSet controller sets (1.20's does not): part of the downgrade.
            index = meta["name"].rsplit("-", 1)[1]
            self.admin.merge(base, {"metadata": {"labels": {POD_INDEX: index}}})
        if not spec.get("nodeName"):
            target = {"apiVersion": "v1", "kind": "Node", "name": _affinity_node(spec) or self.node}
            binding = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": meta["name"]},
                "target": target,
            }
            reply = self.admin.send("POST", f"{base}/binding", binding)
            if reply.status_code in (404, 409):  # deleted meanwhile, or bound by an earlier pass
                return
            reply.raise_for_status()
        if pending:
            return  # scheduled, and its images still pulling
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ip = next(self._ips)
        status = {
            "phase": "Running",
            # Loopback addresses where nothing listens: whoever dials a pod is refused at once, and
            # nothing leaves this machine.
            "podIP": f"127.0.{ip // 250 + 1}.{ip % 250 + 1}",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
            "initContainerStatuses": [
                {
                    "name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
                }
                for c in spec.get("initContainers") or []
            ],
            "containerStatuses": [
                {
                    "name": c["name"], "image": c["image"], "imageID": "", "ready": True, "restartCount": 0,
                    "started": True, "state": {"running": {"startedAt": now}},
                }
                for c in spec["containers"]
            ],
        }  # fmt: skip
        reply = self.admin.send("PATCH", f"{base}/status", {"status": status}, "application/merge-patch+json")
        if reply.status_code != 404:
            reply.raise_for_status()


def register_node(admin: Admin, name: str) -> None:
    """A Ready node, as its kubelet registers it and the node lifecycle controller (not run here)
    then lifts its `not-ready` taint."""
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    admin.send("POST", "/api/v1/nodes", node).raise_for_status()
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "played by the test"}
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    status = {"conditions": [ready], "capacity": capacity, "allocatable": capacity}
    admin.merge(f"/api/v1/nodes/{name}/status", {"status": status})
    admin.merge(f"/api/v1/nodes/{name}", {"spec": {"taints": None}})


def _affinity_node(spec: dict[str, Any]) -> str | None:
    """The node a DaemonSet pod's required node affinity names (`metadata.name In [node]`)."""
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for field_ in term.get("matchFields") or []:
            if field_.get("key") == "metadata.name" and field_.get("values"):
                return str(field_["values"][0])
    return None


# --- the chart, the ServiceAccount's token and the operator process --------------------------------------


def render_chart(
    helm: str, *values: str, release: str = RELEASE, namespace: str = RELEASE_NS
) -> list[dict[str, Any]]:
    """`helm template` of the chart: default values, but VALUES (`--set` assignments)."""
    sets = [arg for value in values for arg in ("--set", value)]
    out = subprocess.run(
        [helm, "template", release, str(REPO / "charts/legorl"), "--namespace", namespace, *sets],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    return [d for d in kubeyaml.load_all(out) if d]


def _component(obj: dict[str, Any]) -> str:
    return str(obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", ""))


def cluster_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-operator"))


def service_account_token(plane: ControlPlane, name: str, namespace: str = RELEASE_NS) -> str:
    """A bound token for the ServiceAccount, from the real TokenRequest API."""
    result = plane.kubectl("create", "token", name, "-n", namespace, "--duration=2h")
    return result.stdout.strip()


@dataclass
class Operator:
    """`legorl operator` (or `legorl ui`) as the chart's Deployment runs it, with the ServiceAccount's
    credentials."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    name: str = "the operator"

    def start(self) -> Operator:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def kill(self) -> None:
        """SIGKILL: no clean-up handler runs, as when a node dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _container_env(deploy: dict[str, Any], pod: str, secrets: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet would set it for pod POD (SECRETS: each secretKeyRef's
    `name/key` → its value), over this process's own, less its Kubernetes and legorl settings."""
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "LEGORL_"))}
    fields = {"metadata.namespace": deploy["metadata"]["namespace"], "metadata.name": pod}
    for var in container.get("env") or []:
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[var["name"]] = secrets[f"{source['secretKeyRef']['name']}/{source['secretKeyRef']['key']}"]
    return env


def operator_command(docs: list[dict[str, Any]], kubeconfig: Path, log: Path, pod: str = "") -> Operator:
    """The chart's operator container as a process, as pod POD (kopf's identity, `POD_ID`): its args
    (ports made free) and its env."""
    deploy = next(d for d in docs if d["kind"] == "Deployment" and _component(d) == "operator")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    args = []
    for arg in container["args"]:
        flag = arg.split("=", 1)[0]
        args.append(f"{flag}={free_port()}" if flag in ("--health-port", "--metrics-port") else arg)
    env = _container_env(deploy, pod or f"{deploy['metadata']['name']}-0", {})
    env["KUBECONFIG"] = str(kubeconfig)
    legorl = str(Path(sys.executable).with_name("legorl"))
    return Operator([legorl, *args, f"--resync-seconds={RESYNC}"], env, log)


def sa_kubeconfig(path: Path, server: str, token: str, ca: Path | None = None) -> Path:
    authority = f"    certificate-authority: {ca}\n" if ca else ""
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: real\n  cluster:\n    server: {server}\n{authority}"
        f"users:\n- name: operator\n  user:\n    token: {token}\n"
        "contexts:\n- name: real\n  context:\n    cluster: real\n    user: operator\n"
        "current-context: real\n"
    )
    path.chmod(0o600)
    return path


@dataclass
class Env:
    plane: ControlPlane
    proxy: Downgrade
    admin: Admin
    kubelet: Kubelet
    operator: Operator
    docs: list[dict[str, Any]]
    user: str
    token: str
    """The operator's ServiceAccount token."""

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.kubelet.check()
            self.operator.check()
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.operator.tail()}")

    def condition(self, path: str, type_: str) -> dict[str, Any] | None:
        obj = self.admin.get(path) or {}
        return next(
            (c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None
        )

    def wait_condition(self, path: str, type_: str, status: str, contains: str = "") -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            cond = self.condition(path, type_)
            return cond if cond and cond["status"] == status and contains in cond.get("message", "") else None

        try:
            cond: dict[str, Any] = self.wait(ok, f"{path} {type_}={status} {contains}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nlast {type_}: {self.condition(path, type_)}") from None
        return cond

    def apply(self, obj: dict[str, Any], manager: str = "researcher") -> None:
        self.plane.kubectl(
            "apply", "--server-side", f"--field-manager={manager}", "-f", "-", stdin=to_yaml(obj)
        )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, helm: str) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("kube-operator")
    with contextlib.ExitStack() as stack:
        plane = stack.enter_context(
            control_plane(
                root,
                audit=True,
                admission=["OwnerReferencesPermissionEnforcement"],
            )
        )
        for path in CRD_FILES:
            plane.kubectl("apply", "--server-side", "-f", "-", stdin=to_yaml(crd_for_120(path)))
        plane.kubectl("apply", "--server-side", "-f", str(KOPF_CRDS))
        for crd in ("rlruns", "sandboxpools", "rolloutfleets"):
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}.legorl.dev", "--timeout=60s")
        plane.kubectl("create", "namespace", RELEASE_NS)
        docs = render_chart(helm)
        # The operator runs as a process instead of its Deployment; nothing serves the UI's.
        chart = [d for d in docs if d["kind"] != "Deployment"]
        plane.kubectl("apply", "--server-side", "-f", "-", stdin="---\n".join(map(to_yaml, chart)))
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
        admin = Admin(plane)
        stack.callback(admin.close)
        register_node(admin, "node-a")
        # The example pool's pods name a RuntimeClass; admission refuses pods whose class is missing.
        plane.kubectl("apply", "--server-side", "-f", "-", stdin=to_yaml(GVISOR))
        proxy = stack.enter_context(Downgrade(plane.url, plane.ca))
        token = service_account_token(plane, sa)
        kubeconfig = sa_kubeconfig(root / "operator.kubeconfig", proxy.url, token)
        kubelet = Kubelet(admin).start()
        stack.callback(kubelet.stop)
        operator = operator_command(docs, kubeconfig, root / "operator.log").start()
        stack.callback(operator.stop)
        user = f"system:serviceaccount:{RELEASE_NS}:{sa}"
        yield Env(plane, proxy, admin, kubelet, operator, docs, user, token)


LIFECYCLES: set[str] = set()
"""The lifecycle tests that passed; the RBAC measurement needs them all."""
OWNERS: set[str] = set()
"""Plurals of the kinds whose children the lifecycles saw carry a blocking owner reference."""
UNSYNCED: list[tuple[datetime, datetime]] = []
"""Spans in which a restarted API server had not yet loaded its RBAC roles: 1.20 serves requests
before its RBAC informers have synced and refuses them (403) meanwhile (kubernetes/kubernetes#121635;
1.22 adds the reason "informers not synced"). kopf retries a refused request with backoff."""


def _path(api_version: str, plural: str, namespace: str, name: str = "") -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


def _served(env: Env, path: str) -> bool:
    return env.admin.http.get(path).status_code == 200


def _gone(env: Env, path: str) -> bool:
    return env.admin.get(path) is None


def _owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    """Whether OBJ has a blocking owner reference to OWNER (which needs `update` on its finalizers)."""
    refs = obj["metadata"].get("ownerReferences") or []
    owned = any(r["uid"] == owner["metadata"]["uid"] and r.get("blockOwnerDeletion") for r in refs)
    if owned:
        OWNERS.add(owner["kind"].lower() + "s")
    return owned


GVISOR = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "gvisor"}, **RUNSC}
FLEET_CHILDREN = [
    ("v1", "services", "coder-fleet-engine"),
    ("apps/v1", "deployments", "coder-fleet-engine"),
    ("policy/v1beta1", "poddisruptionbudgets", "coder-fleet-engine"),  # policy/v1 to the operator
    ("networking.k8s.io/v1", "networkpolicies", "coder-fleet-engine"),
]


def test_a_fleet_is_created_scaled_changed_and_deleted(env: Env) -> None:
    ns = "fleet"
    env.plane.kubectl("create", "namespace", ns)
    fleet = example("RolloutFleet", ns)
    env.apply(fleet)
    path = _path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-fleet")
    env.wait_condition(path, "Ready", "True", "2/2 replicas serve")
    owner = env.admin.get(path)
    assert owner is not None
    deployment = _path("apps/v1", "deployments", ns, "coder-fleet-engine")
    for api_version, plural, name in FLEET_CHILDREN:
        child = env.admin.get(_path(api_version, plural, ns, name))
        assert child is not None and _owned_by(child, owner), (plural, name)
    # Scale: the operator's apply carries the new replica count to the Deployment.
    fleet["spec"]["replicas"] = 1
    env.apply(fleet)
    env.wait(lambda: (env.admin.get(deployment) or {}).get("spec", {}).get("replicas") == 1, "1 replica")
    env.wait_condition(path, "Ready", "True", "1/1 replicas serve")
    # A spec change rolls the engine: the real Deployment controller makes a new ReplicaSet.
    fleet["spec"]["engine"]["image"] = "vllm/vllm-openai:v0.34.0"
    env.apply(fleet)

    def rolled() -> bool:
        spec = (env.admin.get(deployment) or {}).get("spec", {})
        images = [c["image"] for c in spec.get("template", {}).get("spec", {}).get("containers", [])]
        return "vllm/vllm-openai:v0.34.0" in images

    env.wait(rolled, "the new engine image in the Deployment")
    env.wait_condition(path, "Ready", "True", "1/1 replicas serve")
    # Multi-node replicas (no LeaderWorkerSet API yet): StatefulSet groups replace the Deployment,
    # which the operator deletes; back to one node, the groups go.
    fleet["spec"]["parallelism"] |= {"nodesPerReplica": 2, "pipelineParallelSize": 2}
    env.apply(fleet)
    env.wait(lambda: _gone(env, deployment), "the Deployment deleted")
    groups = env.wait(lambda: env.admin.items(_path("apps/v1", "statefulsets", ns), MANAGED), "the groups")
    assert all(_owned_by(g, owner) for g in groups)
    env.wait_condition(path, "Ready", "True", "1/1 replicas serve")
    fleet["spec"]["parallelism"] |= {"nodesPerReplica": 1, "pipelineParallelSize": 1}
    env.apply(fleet)
    env.wait(lambda: not env.admin.items(_path("apps/v1", "statefulsets", ns), MANAGED), "the groups gone")
    env.wait_condition(path, "Ready", "True", "1/1 replicas serve")
    # A ServiceAccount of the user's own: the operator deletes the one it made.
    env.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "engine", "namespace": ns}})
    fleet["spec"]["identity"] = {"serviceAccountName": "engine"}
    env.apply(fleet)
    own = _path("v1", "serviceaccounts", ns, "coder-fleet-engine")
    env.wait(lambda: _gone(env, own), "the operator's ServiceAccount deleted")
    env.wait_condition(path, "Ready", "True", "1/1 replicas serve")
    # Delete: the real garbage collector removes every child (their owner references block deletion).
    env.plane.kubectl("delete", "rolloutfleet", "coder-fleet", "-n", ns, "--wait=true", "--timeout=60s")
    for api_version, plural, name in FLEET_CHILDREN:
        gone = _path(api_version, plural, ns, name)
        env.wait(functools.partial(_gone, env, gone), f"GC of {plural}")
    LIFECYCLES.add("fleet")


def test_a_pool_caches_its_images_on_the_nodes_scales_and_is_deleted(env: Env) -> None:
    ns = "pool"
    env.plane.kubectl("create", "namespace", ns)
    pool = example("SandboxPool", ns)
    del pool["spec"]["source"]["taskSet"]  # a pvc:// task set is read by trials, not by the operator
    env.apply(pool)
    path = _path("legorl.dev/v1alpha1", "sandboxpools", ns, "python-repos")
    env.wait_condition(path, "ImagesCached", "True")
    env.wait_condition(path, "Ready", "True")
    daemonsets = env.admin.items(_path("apps/v1", "daemonsets", ns))
    owner = env.admin.get(path)
    assert owner is not None and daemonsets
    assert all(d["status"].get("numberReady") == 1 and _owned_by(d, owner) for d in daemonsets)
    pool["spec"]["replicas"] = 1  # one warm sandbox
    env.apply(pool)
    env.wait_condition(path, "Ready", "True")
    pool["spec"]["source"]["images"].append("ghcr.io/example/swe-tasks/flask-4045:v1")
    env.apply(pool)
    env.wait(lambda: (env.admin.get(path) or {}).get("status", {}).get("imagesDesired") == 3, "3 images")
    env.wait_condition(path, "ImagesCached", "True")
    # One image per DaemonSet, then one image fewer: the operator deletes the chunk left over.
    pool["spec"]["prePull"]["imagesPerDaemonSet"] = 1
    env.apply(pool)
    env.wait(lambda: len(env.admin.items(_path("apps/v1", "daemonsets", ns))) == 3, "3 DaemonSets")
    pool["spec"]["source"]["images"].pop()
    env.apply(pool)
    env.wait(lambda: len(env.admin.items(_path("apps/v1", "daemonsets", ns))) == 2, "2 DaemonSets")
    env.wait_condition(path, "ImagesCached", "True")
    env.plane.kubectl("delete", "sandboxpool", "python-repos", "-n", ns, "--wait=true", "--timeout=60s")
    env.wait(lambda: not env.admin.items(_path("apps/v1", "daemonsets", ns)), "GC of the DaemonSets")
    env.wait(lambda: not env.admin.items(_path("v1", "pods", ns), MANAGED), "the pool's pods gone")
    LIFECYCLES.add("pool")


def _run_objects(ns: str, store: Path) -> tuple[dict[str, Any], ...]:
    """The example's run in NS with the example's fleet and pool inlined (the operator creates them,
    owned by the run), its tasks in a ConfigMap, its store in a folder."""
    from tests.operator.test_operator_controller import make_repo, task_rows  # noqa: PLC0415

    rows = task_rows(make_repo(store.parent / "pristine"))
    tasks = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tasks", "namespace": ns},
        "data": {"tasks.jsonl": "".join(json.dumps(r) + "\n" for r in rows)},
    }
    fleet, pool, run = (example(kind, ns) for kind in ("RolloutFleet", "SandboxPool", "RLRun"))
    fleet["spec"]["replicas"] = 1
    del pool["spec"]["source"]["taskSet"]
    del run["spec"]["fleetRef"], run["spec"]["poolRef"]
    del fleet["spec"]["model"]  # an inline fleet serves the run's policy
    run["spec"].update(
        {
            "fleet": fleet["spec"],
            "pool": pool["spec"],
            "tasks": {"source": {"uri": "configmap://tasks/tasks.jsonl"}, "split": {"heldOutPercent": 0}},
            "algorithm": {"name": "GRPO", "groupSize": 2, "tasksPerStep": 1},
            "store": {"uri": f"file://{store}"},
            "stop": {"maxSteps": 2},
        }
    )
    return tasks, run


def test_a_run_starts_trials_is_suspended_resumed_and_deleted(env: Env, tmp_path: Path) -> None:
    ns = "run"
    env.plane.kubectl("create", "namespace", ns)
    for obj in _run_objects(ns, tmp_path / "store"):
        env.apply(obj)
    run = _path("legorl.dev/v1alpha1", "rlruns", ns, "coder-grpo")
    # Trial pods stay Pending (their images pulling), so the run keeps them until it is suspended.
    env.kubelet.pending.add("trial")
    env.wait_condition(run, "Validated", "True")
    env.wait_condition(run, "RolloutReady", "True")
    env.wait_condition(run, "SandboxesReady", "True")

    def trials() -> list[dict[str, Any]]:
        pods = env.admin.items(_path("v1", "pods", ns), MANAGED)
        return [p for p in pods if p["metadata"]["labels"].get("legorl.dev/component") == "trial"]

    def jobs() -> list[dict[str, Any]]:
        return env.admin.items(_path("batch/v1", "jobs", ns), MANAGED)

    def trial_config_maps() -> list[dict[str, Any]]:
        maps = env.admin.items(_path("v1", "configmaps", ns))
        return [c for c in maps if c["metadata"]["name"] != "tasks" and c["metadata"].get("ownerReferences")]

    def phase() -> str:
        return str((env.admin.get(run) or {}).get("status", {}).get("phase", ""))

    env.wait(trials, "the run's first trial pods")
    (job,) = env.wait(jobs, "the trainer Job")
    owner = env.admin.get(run)
    assert owner is not None and _owned_by(job, owner)
    _suspend(env, ns, "coder-grpo", True)
    env.wait(lambda: phase() == "Suspended", "phase Suspended")
    env.wait(lambda: not trials(), "no trial pods while suspended")
    _suspend(env, ns, "coder-grpo", False)
    env.wait(trials, "trial pods again after the resume")
    env.plane.kubectl("delete", "rlrun", "coder-grpo", "-n", ns, "--wait=true", "--timeout=90s")
    env.wait(lambda: not jobs(), "GC of the trainer Job")
    env.wait(lambda: not trials(), "no trial pods after the delete")
    env.wait(lambda: not trial_config_maps(), "the trials' ConfigMaps collected")
    LIFECYCLES.add("run")


def test_a_run_that_stops_inlining_and_training_has_what_it_no_longer_renders_deleted(
    env: Env, tmp_path: Path
) -> None:
    ns = "reshape"
    env.plane.kubectl("create", "namespace", ns)
    tasks, run = _run_objects(ns, tmp_path / "store")
    run["spec"]["suspend"] = True  # no trials: only what the run renders matters here
    env.apply(tasks)
    env.apply(run)
    owned = {
        "fleet": _path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-grpo-fleet"),
        "pool": _path("legorl.dev/v1alpha1", "sandboxpools", ns, "coder-grpo-pool"),
    }
    for what, path in owned.items():
        env.wait(functools.partial(env.admin.get, path), f"the run's {what}")
    jobs = _path("batch/v1", "jobs", ns)
    env.wait(lambda: env.admin.items(jobs, MANAGED), "the trainer Job")
    trainer_policy = _path("networking.k8s.io/v1", "networkpolicies", ns, "coder-grpo-trainer")
    env.wait(functools.partial(env.admin.get, trainer_policy), "the trainer's NetworkPolicy")
    # The run now uses a shared fleet and pool, and only evaluates: the operator deletes the fleet
    # and pool it made for the run, the trainer Job and the trainer's NetworkPolicy.
    for kind in ("RolloutFleet", "SandboxPool"):
        shared = example(kind, ns)
        if kind == "SandboxPool":
            del shared["spec"]["source"]["taskSet"]
        env.apply(shared)
    del run["spec"]["fleet"], run["spec"]["pool"]
    run["spec"] |= {
        "mode": "Evaluate",
        "fleetRef": {"name": "coder-fleet"},
        "poolRef": {"name": "python-repos"},
    }
    env.apply(run)
    for what, path in owned.items():
        env.wait(functools.partial(_gone, env, path), f"the run's own {what} deleted")
    env.wait(lambda: not env.admin.items(jobs, MANAGED), "the trainer Job deleted")
    env.wait(functools.partial(_gone, env, trainer_policy), "the trainer's NetworkPolicy deleted")
    env.plane.kubectl("delete", "rlrun", "coder-grpo", "-n", ns, "--wait=true", "--timeout=90s")
    LIFECYCLES.add("reshape")


def _suspend(env: Env, ns: str, name: str, value: bool) -> None:
    patch = json.dumps({"spec": {"suspend": value}})
    env.plane.kubectl("patch", "rlrun", name, "-n", ns, "--type=merge", "-p", patch)


KINDS = {
    "services": "Service",
    "deployments": "Deployment",
    "poddisruptionbudgets": "PodDisruptionBudget",
    "networkpolicies": "NetworkPolicy",
    "serviceaccounts": "ServiceAccount",
}


def _managed(env: Env, ns: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Every operator-managed child in NS (pods aside), by (kind, name)."""
    out = {}
    for api_version, plural, _ in [*FLEET_CHILDREN, ("v1", "serviceaccounts", "")]:
        for obj in env.admin.items(_path(api_version, plural, ns), MANAGED):
            out[(KINDS[plural], obj["metadata"]["name"])] = obj
    return out


def test_another_managers_change_to_an_owned_field_conflicts_and_a_forced_one_is_undone(env: Env) -> None:
    ns = "ssa"
    env.plane.kubectl("create", "namespace", ns)
    fleet = example("RolloutFleet", ns)
    env.apply(fleet)
    deployment = _path("apps/v1", "deployments", ns, "coder-fleet-engine")
    got = env.wait(lambda: env.admin.get(deployment), "the engine Deployment")
    assert "legorl-operator" in {m["manager"] for m in got["metadata"]["managedFields"]}
    change = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "coder-fleet-engine", "namespace": ns},
        "spec": {"replicas": 7},
    }
    # --validate=false: a partial object, which kubectl's own check of the whole schema refuses.
    args = ["apply", "--server-side", "--field-manager=intruder", "--validate=false", "-f", "-"]
    refused = env.plane.kubectl(*args, stdin=json.dumps(change), check=False)
    assert refused.returncode != 0 and "conflict" in refused.stderr.lower(), refused.stderr
    assert "legorl-operator" in refused.stderr  # the server names the field's owner
    env.plane.kubectl(*args, "--force-conflicts", stdin=json.dumps(change))
    # The operator takes the field back at its next full resync (every --resync-seconds): the
    # change left the child's desired-state hash as it was, so the reconcile it woke skipped it.
    env.wait(
        lambda: (env.admin.get(deployment) or {}).get("spec", {}).get("replicas") == 2, "replicas 2 again"
    )
    # The status subresource: a spec update never touches what the operator wrote to .status.
    path = _path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-fleet")
    env.wait_condition(path, "Ready", "True")
    stale = env.admin.get(path)
    assert stale is not None
    fleet["spec"]["startupSeconds"] = 1200
    env.apply(fleet)
    # A write from a stale copy (an old resourceVersion) is refused, not merged.
    stale["spec"]["replicas"] = 5
    reply = env.admin.send("PUT", path, stale)
    assert reply.status_code == 409 and reply.json()["reason"] == "Conflict", reply.text
    assert (env.admin.get(path) or {})["spec"]["replicas"] == 2
    env.wait_condition(path, "Ready", "True")
    env.plane.kubectl("delete", "rolloutfleet", "coder-fleet", "-n", ns, "--wait=true", "--timeout=60s")


def test_a_killed_operator_leaves_no_duplicate_or_orphaned_children(env: Env) -> None:
    ns = "killed"
    env.plane.kubectl("create", "namespace", ns)
    fleet = example("RolloutFleet", ns)
    # Hold the operator's apply of the PodDisruptionBudget and kill it (SIGKILL) while that request is
    # in flight: some children are applied, the rest not, nothing of it is written down.
    with env.proxy.hold("PATCH", rf"/namespaces/{ns}/poddisruptionbudgets/") as held:
        env.apply(fleet)
        env.wait(held.is_set, "the operator's apply of the PDB")
        before = _managed(env, ns)
        env.operator.kill()
    assert ("Deployment", "coder-fleet-engine") in before
    assert ("PodDisruptionBudget", "coder-fleet-engine") not in before
    env.operator.start()
    path = _path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-fleet")
    env.wait_condition(path, "Ready", "True", "2/2 replicas serve")
    owner = env.admin.get(path)
    assert owner is not None
    after = _managed(env, ns)
    assert set(before) < set(after)
    assert all(_owned_by(obj, owner) for obj in after.values()), "a child without its owner"
    replica_sets = env.admin.items(_path("apps/v1", "replicasets", ns))
    assert len(replica_sets) == 1, "the restarted operator changed the engine's template"
    env.plane.kubectl("delete", "rolloutfleet", "coder-fleet", "-n", ns, "--wait=true", "--timeout=60s")
    env.wait(lambda: not _managed(env, ns), "every child collected: none orphaned")


def test_the_watches_survive_an_api_server_restart_and_a_history_gone(env: Env) -> None:
    ns = "restart"
    env.plane.kubectl("create", "namespace", ns)
    fleet = example("RolloutFleet", ns)
    fleet["spec"]["replicas"] = 1
    env.apply(fleet)
    path = _path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-fleet")
    env.wait_condition(path, "Ready", "True", "1/1 replicas serve")
    # The operator's watches of legorl's kinds are cut and cannot reconnect for a while; the fleet
    # changes meanwhile and the API server restarts, so its watch cache begins after the watches'
    # last resourceVersion: a watch resuming from there gets 410 Gone and has to list again.
    # They stay held until the restarted server serves the custom resources: 1.20 answers 404 for
    # them for a moment after /readyz, and kopf takes a 404 on a watch as fatal (the operator exits,
    # and its Deployment would restart it).
    gone = env.proxy.rewritten["watch-gone"]
    restarted = datetime.now(UTC)
    with env.proxy.hold("GET", r"^/apis/legorl\.dev/"):
        for i in range(3):
            env.apply({**fleet, "metadata": {**fleet["metadata"], "annotations": {"touch": str(i)}}})
        env.plane.restart_apiserver(down_seconds=2)
        for plural in ("rlruns", "rolloutfleets", "sandboxpools"):
            served = f"/apis/legorl.dev/v1alpha1/{plural}"
            env.wait(functools.partial(_served, env, served), f"{plural} served again")
    # The operator's other watches reconnect at once, possibly before the server's roles are loaded.
    with _as_operator(env) as client:
        grants = granted(env.docs)
        env.wait(lambda: all(_allowed(client, *g) for g in grants), "the restarted server's RBAC loaded")
    UNSYNCED.append((restarted, datetime.now(UTC)))
    env.wait(lambda: env.proxy.rewritten["watch-gone"] > gone, "a watch told its history is gone (410)")
    fleet["spec"]["replicas"] = 2
    env.apply(fleet)
    env.wait_condition(path, "Ready", "True", "2/2 replicas serve")
    env.plane.kubectl("delete", "rolloutfleet", "coder-fleet", "-n", ns, "--wait=true", "--timeout=60s")


LWS_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {
        "group": "leaderworkerset.x-k8s.io",
        "scope": "Namespaced",
        "names": {"plural": "leaderworkersets", "singular": "leaderworkerset", "kind": "LeaderWorkerSet"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}
"""A stand-in for the LeaderWorkerSet CRD (lws v0.x, `leaderworkerset.x-k8s.io/v1`): its group,
version and names; its schema is not vendored (no network here), and no LWS controller runs."""


def test_with_the_leader_worker_set_api_a_multi_node_fleet_is_one(env: Env) -> None:
    ns = "lws"
    env.plane.kubectl("create", "namespace", ns)
    env.apply(LWS_CRD)
    env.plane.kubectl("wait", "--for=condition=Established", "crd/leaderworkersets.leaderworkerset.x-k8s.io")
    env.operator.stop()  # the operator looks for the API when it starts
    env.operator.start()
    fleet = example("RolloutFleet", ns)
    fleet["spec"]["parallelism"] |= {"nodesPerReplica": 2, "pipelineParallelSize": 2}
    env.apply(fleet)
    owner = env.wait(
        lambda: env.admin.get(_path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-fleet")), ""
    )
    lws = _path("leaderworkerset.x-k8s.io/v1", "leaderworkersets", ns, "coder-fleet-engine")
    got = env.wait(lambda: env.admin.get(lws), "the fleet's LeaderWorkerSet")
    assert _owned_by(got, owner) and got["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert not env.admin.items(_path("apps/v1", "statefulsets", ns), MANAGED)
    fleet["spec"]["parallelism"] |= {"nodesPerReplica": 1, "pipelineParallelSize": 1}
    env.apply(fleet)
    env.wait(lambda: _gone(env, lws), "the LeaderWorkerSet deleted for a Deployment")
    env.wait(
        lambda: env.admin.get(_path("apps/v1", "deployments", ns, "coder-fleet-engine")), "the Deployment"
    )
    env.plane.kubectl("delete", "rolloutfleet", "coder-fleet", "-n", ns, "--wait=true", "--timeout=60s")
    LIFECYCLES.add("lws")


# --- least privilege, measured --------------------------------------------------------------------------

Permission = tuple[str, str, str]
"""(API group, resource[/subresource], verb), as RBAC rules name them."""

NOT_EXERCISED: set[Permission] = {
    # A trial pod the pod watch has not shown within appearSeconds (30 s) is looked up directly.
    ("", "pods", "get"),
}
"""Grants whose code path these lifecycles do not reach (the test fails if this set is stale)."""


def granted(docs: list[dict[str, Any]]) -> set[Permission]:
    """Every (group, resource, verb) the chart's ClusterRoles give the operator."""
    out: set[Permission] = set()
    for role in (d for d in docs if d["kind"] == "ClusterRole"):
        for rule in role["rules"]:
            out |= set(itertools.product(rule["apiGroups"], rule["resources"], rule["verbs"]))
    return out


RBAC_DOC = REPO / "docs/operator.md"


def rbac_table(name: str) -> dict[tuple[str, str], tuple[set[str], set[str]]]:
    """docs/operator.md's RBAC table NAME: (API group, resource) → (verbs used, verbs granted and not
    used). Verbs are the backquoted words of a cell (of a "not used" cell, those before its `:`)."""
    text = RBAC_DOC.read_text()
    body = text.split(f"<!-- rbac-{name}:start -->", 1)[1].split(f"<!-- rbac-{name}:end -->", 1)[0]
    lines = [line.strip() for line in body.splitlines() if line.strip().startswith("|")]
    rows: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for line in lines[2:]:
        group, resource, used_, unused, *_ = (c.strip() for c in line.strip("|").split("|"))
        key = ("" if group == "core" else group.strip("`"), resource.strip("`"))
        rows[key] = (set(re.findall(r"`(\w+)`", used_)), set(re.findall(r"`(\w+)`", unused.split(":")[0])))
    return rows


def check_rbac_table(name: str, grants: set[Permission], needed: set[Permission]) -> None:
    """docs/operator.md's table NAME is what was measured: every grant, used or not."""
    measured: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for group, resource, verb in sorted(grants):
        used_, unused = measured.setdefault((group, resource), (set(), set()))
        (used_ if (group, resource, verb) in needed else unused).add(verb)
    if rbac_table(name) != measured:
        lines = "\n".join(
            f"| {g or 'core'} | {r} | {', '.join(f'`{v}`' for v in sorted(u))} | "
            f"{', '.join(f'`{v}`' for v in sorted(n))} |"
            for (g, r), (u, n) in measured.items()
        )
        pytest.fail(f"docs/operator.md's rbac-{name} table is stale; measured:\n{lines}")


def used(events: list[dict[str, Any]], user: str) -> tuple[set[Permission], list[str]]:
    """What USER's requests needed, from the audit log, and the requests the server refused (403).

    A server-side apply that created its object (201) needed `create` as well as `patch`: the API
    server authorizes that create separately, and the audit log records only the request's verb."""
    needed: set[Permission] = set()
    refused: list[str] = []
    for event in events:
        ref = event.get("objectRef")
        if event["user"]["username"] != user or not ref:
            continue  # another user's, or a non-resource URL (/apis, /version: system:discovery)
        if event.get("userAgent") == AS_OPERATOR:
            continue  # this test's own requests with the operator's token (access reviews)
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        code = (event.get("responseStatus") or {}).get("code", 0)
        received = datetime.fromisoformat(event["requestReceivedTimestamp"])
        if code == 403 and not any(begin <= received <= end for begin, end in UNSYNCED):
            refused.append(f"{event['verb']} {event['requestURI']}")
        needed.add((ref.get("apiGroup", ""), resource, event["verb"]))
        if event["verb"] == "patch" and code == 201:
            needed.add((ref.get("apiGroup", ""), resource, "create"))
    return needed, refused


def test_the_chart_grants_exactly_what_the_lifecycles_use(env: Env) -> None:
    """Removing any one grant would make a lifecycle request above fail; no request was refused."""
    missing = {"fleet", "pool", "run", "reshape", "lws"} - LIFECYCLES
    if missing:
        pytest.fail(f"the {sorted(missing)} lifecycle tests of this module must pass first: run the module")
    needed, refused = used(env.plane.audit_events(), env.user)
    # Blocking owner references need `update` on the owner's finalizers (checked at admission, so
    # not in the audit log; test_a_blocking_owner_reference_needs_the_owners_finalizers shows it).
    needed |= {("legorl.dev", f"{plural}/finalizers", "update") for plural in OWNERS}
    assert not refused, refused
    grants = granted(env.docs)
    assert needed <= grants, sorted(needed - grants)
    assert grants - needed == NOT_EXERCISED, f"granted, never used: {sorted(grants - needed)}"
    check_rbac_table("operator", grants, needed)


AS_OPERATOR = "legorl-tests/as-operator"
"""The User-Agent of this test's requests made with the operator's token, which are not the operator's."""


def _as_operator(env: Env) -> httpx.Client:
    """A client with the operator's ServiceAccount token, straight to the server."""
    return httpx.Client(
        base_url=env.plane.url,
        verify=ssl.create_default_context(cafile=str(env.plane.ca)),
        headers={"Authorization": f"Bearer {env.token}", "User-Agent": AS_OPERATOR},
        timeout=30,
    )


@contextlib.contextmanager
def _without(env: Env, client: httpx.Client, resource: str, verb: str) -> Iterator[None]:
    """The chart's operator ClusterRole with VERB removed from the rule that grants it on RESOURCE,
    in force (as the operator's own access review says) for the block."""
    group = "legorl.dev" if resource.partition("/")[0] in ("rlruns", "sandboxpools", "rolloutfleets") else ""
    role = cluster_role(env.docs)
    trimmed = json.loads(json.dumps(role))
    for rule in trimmed["rules"]:
        if resource in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    trimmed["rules"] = [rule for rule in trimmed["rules"] if rule["verbs"]]
    force = ["apply", "--server-side", "--force-conflicts", "-f", "-"]
    env.plane.kubectl(*force, stdin=to_yaml(trimmed))
    try:
        env.wait(lambda: not _allowed(client, group, resource, verb), f"{verb} {resource} revoked")
        yield
    finally:
        env.plane.kubectl(*force, stdin=to_yaml(role))
        env.wait(lambda: _allowed(client, group, resource, verb), f"{verb} {resource} granted again")


def _allowed(client: httpx.Client, group: str, resource: str, verb: str) -> bool:
    """Whether the client's user may VERB RESOURCE in the default namespace (SelfSubjectAccessReview:
    the RBAC authorizer's answer once its informer has the latest roles)."""
    name, _, sub = resource.partition("/")
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {
            "namespace": "default", "verb": verb, "group": group, "resource": name, "subresource": sub,
        }},
    }  # fmt: skip
    reply = client.post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", json=review)
    reply.raise_for_status()
    return bool(reply.json()["status"].get("allowed"))


def _apply_as(client: httpx.Client, obj: dict[str, Any]) -> int:
    meta = obj["metadata"]
    reply = client.patch(
        _path(obj["apiVersion"], obj["kind"].lower() + "s", meta["namespace"], meta["name"]),
        content=json.dumps(obj),
        params={"fieldManager": "legorl-operator", "force": "true"},
        headers={"Content-Type": "application/apply-patch+yaml"},
    )
    return reply.status_code


def test_an_apply_that_creates_needs_create_and_one_that_updates_does_not(env: Env) -> None:
    env.plane.kubectl("create", "namespace", "ablate-create", check=False)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ablate-create"}}
    with _as_operator(env) as client:
        with _without(env, client, "configmaps", "create"):
            assert _apply_as(client, cm) == 403
        assert _apply_as(client, cm) == 201
        with _without(env, client, "configmaps", "create"):
            assert _apply_as(client, {**cm, "data": {"k": "v"}}) == 200


def test_a_blocking_owner_reference_needs_the_owners_finalizers(env: Env) -> None:
    ns = "ablate-owner"
    env.plane.kubectl("create", "namespace", ns, check=False)
    fleet = example("RolloutFleet", ns)
    fleet["spec"]["replicas"] = 0
    env.apply(fleet)
    owner = env.admin.get(_path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-fleet"))
    assert owner is not None
    ref = {
        "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": "coder-fleet",
        "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "owned", "namespace": ns, "ownerReferences": [ref]},
    }
    with _as_operator(env) as client:
        with _without(env, client, "rolloutfleets/finalizers", "update"):
            assert _apply_as(client, cm) == 403
        assert _apply_as(client, cm) == 201


# --- the UI and kopf peering, measured the same way -----------------------------------------------------


def _until(predicate: Callable[[], Any], what: str, procs: list[Operator], timeout: float = TIMEOUT) -> Any:
    """PREDICATE's first true value, while every process of PROCS keeps running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            proc.check()
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.log.name}\n{p.tail(15)}" for p in procs)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


def _apply_chart(env: Env, docs: list[dict[str, Any]]) -> None:
    """The rendered chart but its Deployments (their containers run as processes here)."""
    chart = [d for d in docs if d["kind"] != "Deployment"]
    env.plane.kubectl("apply", "--server-side", "-f", "-", stdin="---\n".join(map(to_yaml, chart)))


def _user(docs: list[dict[str, Any]], component: str) -> str:
    sa = next(d for d in docs if d["kind"] == "ServiceAccount" and _component(d) == component)
    return f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"


UI_VALUES = ("ui.enabled=true", "ui.actionTokenSecret=legorl-ui-action")
"""The UI with its actions (pause, resume, validate): the read-only UI's role is this one less `patch`."""
UI_ACTION_TOKEN = "the-ui-action-token"
"""The token in the Secret `ui.actionTokenSecret` names (the UI's env, as its kubelet would set it)."""

UI_NOT_EXERCISED: set[Permission] = set()
"""Grants of the UI's role that no request of the UI needs (the test fails if this set is stale)."""


def ui_command(docs: list[dict[str, Any]], kubeconfig: Path, log: Path) -> tuple[Operator, str]:
    """The chart's UI container as a process on a free loopback port, and its URL."""
    deploy = next(d for d in docs if d["kind"] == "Deployment" and _component(d) == "ui")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    port = free_port()
    given = {"--host": "--host=127.0.0.1", "--port": f"--port={port}"}
    args = [given.get(arg.split("=", 1)[0], arg) for arg in container["args"]]
    secret = f"{UI_VALUES[1].split('=', 1)[1]}/token"
    env = _container_env(deploy, f"{deploy['metadata']['name']}-0", {secret: UI_ACTION_TOKEN})
    env["KUBECONFIG"] = str(kubeconfig)
    legorl = str(Path(sys.executable).with_name("legorl"))
    return Operator([legorl, *args], env, log, name="the UI"), f"http://127.0.0.1:{port}"


def test_the_ui_uses_what_the_chart_grants_it_and_nothing_is_refused(
    env: Env, helm: str, tmp_path: Path
) -> None:
    """The UI (`ui.enabled`, with an action token) under its own ServiceAccount and role: every
    endpoint that reads the cluster and every action, then the audit log as for the operator."""
    docs = [d for d in render_chart(helm, *UI_VALUES) if _component(d) == "ui"]
    _apply_chart(env, docs)
    user = _user(docs, "ui")
    ns = "ui"
    env.plane.kubectl("create", "namespace", ns)
    tasks, run = _run_objects(ns, tmp_path / "store")
    run["spec"]["suspend"] = True  # what the UI shows needs no trials
    env.apply(tasks)
    env.apply(run)
    path = _path("legorl.dev/v1alpha1", "rlruns", ns, "coder-grpo")
    fleet = _path("legorl.dev/v1alpha1", "rolloutfleets", ns, "coder-grpo-fleet")
    env.wait_condition(path, "Validated", "True")
    env.wait(lambda: (env.admin.get(fleet) or {}).get("status", {}).get("selector"), "the fleet's selector")
    pool = _path("legorl.dev/v1alpha1", "sandboxpools", ns, "coder-grpo-pool")
    env.wait(functools.partial(env.admin.get, pool), "the run's pool")
    env.wait(lambda: env.admin.items(_path("v1", "events", ns)), "the run's Events")
    token = service_account_token(env.plane, user.rsplit(":", 1)[1])
    kubeconfig = sa_kubeconfig(tmp_path / "ui.kubeconfig", env.plane.url, token, ca=env.plane.ca)
    ui, url = ui_command(docs, kubeconfig, tmp_path / "ui.log")
    ui.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as client:

            def healthy() -> bool:
                try:
                    return client.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return False

            _until(healthy, "the UI serving", [ui, env.operator])
            run_id = f"{ns}~coder-grpo"
            runs = client.get("/api/runs")
            assert runs.status_code == 200 and not runs.json()["cluster_note"], runs.text
            assert run_id in {r["id"] for r in runs.json()["runs"]}
            base = f"/api/runs/{run_id}"
            codes = {}
            for sub in ("", "/curves", "/outcomes", "/tasks", "/trials", "/trials/t-0", "/fleet",
                        "/sandboxes", "/diagnostics"):  # fmt: skip
                codes[sub] = client.get(base + sub).status_code
            codes["compare"] = client.get("/api/compare", params={"runs": f"{run_id},{ns}~gone"}).status_code
            for sub in ("", "/fleet", "/sandboxes", "/diagnostics"):
                assert codes[sub] == 200, (sub, codes)
            assert all(code < 500 for code in codes.values()), codes
            assert client.get(base + "/fleet").json()["available"] is True
            bearer = {"Authorization": f"Bearer {UI_ACTION_TOKEN}"}
            for action in ("validate", "resume", "pause"):
                reply = client.post(f"{base}/actions/{action}", headers=bearer)
                assert reply.status_code == 200, (action, reply.text)
        assert (env.admin.get(path) or {})["spec"]["suspend"] is True
    finally:
        ui.stop()
    needed, refused = used(env.plane.audit_events(), user)
    assert not refused, refused
    grants = granted(docs)
    assert needed <= grants, sorted(needed - grants)
    assert grants - needed == UI_NOT_EXERCISED, f"granted, never used: {sorted(grants - needed)}"
    check_rbac_table("ui", grants, needed)
    env.plane.kubectl("delete", "rlrun", "coder-grpo", "-n", ns, "--wait=true", "--timeout=90s")


PEERINGS = {
    # release: (its namespace, chart values, replicas run here, the peering resource kopf uses)
    "peer": (
        "legorl-peer",
        ("operator.peering.enabled=true", "operator.replicas=2"),
        2,
        "/apis/kopf.dev/v1/clusterkopfpeerings/peer-legorl",
    ),
    "peerns": (
        "legorl-peerns",
        ("operator.peering.enabled=true", "watchNamespaces={peer-a}"),
        1,
        "/apis/kopf.dev/v1/namespaces/peer-a/kopfpeerings/peerns-legorl",
    ),
}
"""Two releases beside the module's, with peering: cluster-wide (a ClusterKopfPeering; two replicas, as
the chart's Deployment runs) and limited to a namespace (a KopfPeering there; one replica, which then
serves that namespace under the namespaced RBAC)."""

PEERING_NOT_EXERCISED: dict[str, set[Permission]] = {"peer": set(), "peerns": set()}
"""kopf.dev grants no request of kopf's peering needs, by release (the test fails if stale)."""

PEERING_LOGS: dict[str, str] = {}
"""The cluster-wide replicas' logs, by pod name, for test_two_peering_replicas_leave_one_active."""


def test_kopf_peering_uses_what_the_chart_grants_it_and_nothing_is_refused(
    env: Env, helm: str, tmp_path: Path
) -> None:
    """kopf's peering (`operator.peering.enabled`) as the chart sets it up, on this 1.20 server (the
    fixture applied kopf's peering CRDs from the chart's crds/): each replica announces itself in the
    peering object and watches it. The module's operator is stopped meanwhile (two cluster-wide
    operators would both reconcile)."""
    env.plane.kubectl("create", "namespace", "peer-a", check=False)
    replicas: dict[str, list[Operator]] = {}
    renders: dict[str, list[dict[str, Any]]] = {}
    for release, (namespace, values, count, _) in PEERINGS.items():
        env.plane.kubectl("create", "namespace", namespace, check=False)
        docs = renders[release] = render_chart(helm, *values, release=release, namespace=namespace)
        _apply_chart(env, docs)
        token = service_account_token(env.plane, _user(docs, "operator").rsplit(":", 1)[1], namespace)
        kubeconfig = sa_kubeconfig(tmp_path / f"{release}.kubeconfig", env.proxy.url, token)
        replicas[release] = [
            operator_command(docs, kubeconfig, tmp_path / f"{release}-{i}.log", pod=f"{release}-operator-{i}")
            for i in range(count)
        ]
    procs = [proc for group in replicas.values() for proc in group]

    def announced(release: str) -> bool:
        peers = (env.admin.get(PEERINGS[release][3]) or {}).get("status") or {}
        return {p.env["POD_ID"] for p in replicas[release]} <= set(peers)

    def watching(release: str) -> bool:
        user = _user(renders[release], "operator")
        verbs = {
            e["verb"]
            for e in env.plane.audit_events()
            if e["user"]["username"] == user and (e.get("objectRef") or {}).get("apiGroup") == "kopf.dev"
        }
        return {"list", "watch", "patch"} <= verbs

    env.operator.stop()
    try:
        for proc in procs:
            proc.start()
        for release in PEERINGS:
            _until(functools.partial(announced, release), f"{release}'s replicas in their peering", procs)
            _until(functools.partial(watching, release), f"{release}'s replicas watching it", procs)

        def one_active() -> bool:
            return sum(map(_serving, (p.log.read_text(errors="replace") for p in replicas["peer"]))) == 1

        # What two replicas do is the next test's. kopf starts a replica paused until it has seen the
        # peering object; the one that finds a peer of higher priority stays paused, silently (it logs
        # "Pausing ..." only when it was serving already). 20 s was too short on CI's loaded machine.
        with contextlib.suppress(AssertionError):
            _until(one_active, "exactly one replica serving", procs, timeout=90)
        PEERING_LOGS.update({p.env["POD_ID"]: p.log.read_text(errors="replace") for p in replicas["peer"]})
    finally:
        for proc in procs:
            proc.stop()  # kopf's last keep-alive takes the replica out of the peering object
        env.operator.start()
    events = env.plane.audit_events()
    for release, docs in renders.items():
        needed, refused = used(events, _user(docs, "operator"))
        assert not refused, (release, refused)
        grants = {p for p in granted(docs) if p[0] == "kopf.dev"}
        needed = {p for p in needed if p[0] == "kopf.dev"}
        assert needed <= grants, (release, sorted(needed - grants))
        unused = grants - needed
        assert unused == PEERING_NOT_EXERCISED[release], f"{release}: granted, never used: {sorted(unused)}"
        check_rbac_table(release, grants, needed)


def test_two_peering_replicas_leave_one_active() -> None:
    """With the same priority kopf pauses every replica and nothing is served; each replica draws its own,
    and exactly one serves."""
    if not PEERING_LOGS:
        pytest.skip("needs test_kopf_peering_uses_what_the_chart_grants_it_and_nothing_is_refused first")
    # kopf's warning; its "Resuming ... Conflicting operators with the same priority are gone" is not one.
    same = [
        pod
        for pod, log in PEERING_LOGS.items()
        if "Possibly conflicting operators with the same priority" in log
    ]
    assert not same, f"{same} warned of a peer with the same priority and paused"
    serving = [pod for pod, log in PEERING_LOGS.items() if _serving(log)]
    assert len(serving) == 1, {pod: _peering_lines(log) for pod, log in PEERING_LOGS.items()}


def _peering_lines(log: str) -> list[str]:
    """kopf's peering decisions in a replica's log, in order."""
    return [
        line for line in log.splitlines() if "Resuming operations" in line or "Pausing operations" in line
    ]


def _serving(log: str) -> bool:
    """kopf starts a replica paused until it has read the peering object: it serves once its last peering
    decision is to resume (a replica that never resumed is paused)."""
    lines = _peering_lines(log)
    return bool(lines) and "Resuming operations" in lines[-1]
