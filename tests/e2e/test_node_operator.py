"""The chart's operator as a pod on a real kubelet: `helm install` on the contained 1.20 node.

tests/support/kubenode.py starts the node (tests/e2e/test_real_node.py shows what it is). Here the chart from
charts/legorl is installed with helm — default RBAC, the restricted security contexts of its values,
the images already on the node (`IfNotPresent`) and the UI enabled — and the kubelet runs the
operator and the UI: their probes answered, the operator as the chart's ServiceAccount with the
in-cluster config the kubelet gives every pod. A SandboxPool of images on the node is cached by a
real pre-pull DaemonSet pod, and the operator's container survives a SIGKILL.

What is test infrastructure, and why (docs/real-node.md has the picture):
- The node is Kubernetes 1.20; the operator renders for >= 1.30 (policy/v1 PDBs, newer Job fields,
  native sidecars). So the node is started with `api_downgrade`: the `kubernetes` Service's endpoint
  is tests/kube120's Downgrade (behind a TLS front with the API server's own certificate) instead of
  the API server. Pods — the operator's among them — reach the API as any pod does (kopf logs in to
  `https://kubernetes.default.svc` with the mounted token and CA) and see policy/v1; nothing in the
  chart or in the pod is changed for it.
- The chart declares `kubeVersion: >=1.30.0-0`, which helm checks against the server (v1.20.2): it is
  installed from a copy with that one line removed. Helm 4 applies CRDs server-side, and 1.20 refuses
  their CEL rules (`x-kubernetes-validations`): the chart's CRDs are applied with the rules removed
  first and the release is installed with `--skip-crds`.
- The pool names the node's pause image (`k8s.gcr.io/pause:3.2`, imported by the node) as its
  `prePull.pauseImage`: the default is pulled from registry.k8s.io, which no pod here can reach.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from legorl.api.crd import without_keyword
from legorl.manifests import kubeyaml
from legorl.manifests.generated import to_yaml
from tests.support.kubenode import (
    API_SERVICE_IP,
    CLUSTER_DOMAIN,
    NODE_NAME,
    PAUSE_IMAGE,
    RESTRICTED,
    RESTRICTED_POD,
    Node,
    node,
    pids_in_cgroup,
    skip_unless_node_can_run,
)

REPO = Path(__file__).resolve().parents[2]
PROXY = "ghcr.io/legorl/proxy:0.1.0"
OPERATOR = "ghcr.io/legorl/operator:0.1.0"
RELEASE, RELEASE_NS = "demo", "legorl-system"
FULLNAME = f"{RELEASE}-legorl"
NS = "pools"
POOL_NAME = "local-images"
PYTHON = "/opt/legorl/venv/bin/python"
TIMEOUT = 180.0

skip_unless_node_can_run([PROXY, OPERATOR])

pytestmark = pytest.mark.slow


@dataclass
class Release:
    """The installed chart on the node, and what was measured on the way."""

    node: Node
    timings: dict[str, float] = field(default_factory=dict)

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(
            f"timed out after {timeout:.0f} s waiting for {what}\n--- operator\n{self.operator_log()}"
            f"\n--- pods\n{self.node.kubectl('get', 'pods', '-A', '-o', 'wide', check=False).stdout}"
            f"\n--- kubelet\n{self.node.tail('kubelet')}\n--- downgrade\n{self.node.tail('downgrade')}"
        )

    def operator_log(self, lines: int = 40) -> str:
        got = self.node.kubectl(
            "logs", "-n", RELEASE_NS, f"deployment/{FULLNAME}-operator", f"--tail={lines}", check=False
        )
        return got.stdout + got.stderr

    def pod(self, component: str, namespace: str = RELEASE_NS) -> dict[str, Any] | None:
        """The one pod of COMPONENT (`app.kubernetes.io/component`) not being deleted, if any."""
        pods = self.node.get_json("pods", "-n", namespace, "-l", f"app.kubernetes.io/component={component}")[
            "items"
        ]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        assert len(live) <= 1, [p["metadata"]["name"] for p in live]
        return live[0] if live else None

    def ready_pod(self, component: str) -> dict[str, Any] | None:
        pod = self.pod(component)
        if pod is None:
            return None
        conditions = pod["status"].get("conditions") or []
        return pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None


def helm_cmd(cluster: Node, helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    """helm as the admin, inside the node's namespace (where the API server is), its state in ROOT."""
    home = cluster.root / "helm"
    env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
    argv = cluster.inside(helm, f"--kubeconfig={cluster.kubeconfig()}", *args)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    if result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def chart_for_120(into: Path) -> Path:
    """A copy of charts/legorl whose Chart.yaml does not require Kubernetes >= 1.30 (the only change)."""
    chart = into / "legorl"
    shutil.copytree(REPO / "charts/legorl", chart)
    meta = chart / "Chart.yaml"
    text = meta.read_text()
    lifted = re.sub(r"(?m)^kubeVersion: .*\n", "", text)
    assert lifted != text, "the chart no longer declares kubeVersion: drop chart_for_120"
    meta.write_text(lifted)
    return chart


def install_crds_for_120(cluster: Node) -> None:
    """The chart's own CRDs, as helm would install them, less the CEL rules 1.20 refuses."""
    names = []
    for path in sorted((REPO / "charts/legorl/crds").glob("*.yaml")):
        for crd in kubeyaml.load_all(path.read_text()):
            if crd:
                plain = without_keyword(crd, "x-kubernetes-validations")
                cluster.kubectl("apply", "--server-side", "-f", "-", stdin=to_yaml(plain))
                names.append(crd["metadata"]["name"])

    # Polled, not `kubectl wait`: kubectl 1.37 fails at once on a CRD whose status has no
    # conditions yet ("accessor error: <nil>"), which a 1.20 server shows for a moment.
    def established() -> bool:
        crds = cluster.get_json("crd", *names)["items"]
        conditions = [c for crd in crds for c in (crd.get("status") or {}).get("conditions") or []]
        ready = [c for c in conditions if (c["type"], c["status"]) == ("Established", "True")]
        return len(ready) == len(names)

    deadline = time.monotonic() + 60
    while not established():
        assert time.monotonic() < deadline, f"CRDs not Established: {names}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory, helm: str) -> Iterator[Release]:
    root = tmp_path_factory.mktemp("node")
    with node(root, api_downgrade=True) as cluster:
        install_crds_for_120(cluster)
        chart = chart_for_120(tmp_path_factory.mktemp("chart"))
        rel = Release(cluster, dict(cluster.timings))
        start = time.monotonic()
        helm_cmd(
            cluster, helm, "install", RELEASE, str(chart), "--namespace", RELEASE_NS,
            "--create-namespace", "--skip-crds", "--set", "ui.enabled=true",
        )  # fmt: skip
        rel.timings["helm_install"] = time.monotonic() - start
        rel.wait(lambda: rel.ready_pod("operator"), "the operator pod Ready")
        rel.timings["install_to_operator_ready"] = time.monotonic() - start
        rel.wait(lambda: rel.ready_pod("ui"), "the UI pod Ready")
        rel.timings["install_to_ui_ready"] = time.monotonic() - start
        yield rel
        figures = json.dumps({k: round(v, 1) for k, v in rel.timings.items()})
        (root / "release-timings.json").write_text(figures + "\n")
        print(f"timings (s): {figures}")


def exec_in(
    rel: Release, pod: dict[str, Any], *argv: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    meta = pod["metadata"]
    return rel.node.kubectl("exec", "-n", meta["namespace"], meta["name"], "--", *argv, check=check)


def test_the_operator_runs_as_a_pod_of_the_chart(release: Release) -> None:
    pod = release.ready_pod("operator")
    assert pod is not None
    print(f"helm install -> operator Ready: {release.timings['install_to_operator_ready']:.1f} s")
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert pod["status"]["phase"] == "Running" and spec["nodeName"] == NODE_NAME
    assert container["image"] == OPERATOR and container["imagePullPolicy"] == "IfNotPresent"
    # The chart's ServiceAccount, its token mounted (the SA itself does not automount; the pod does).
    assert spec["serviceAccountName"] == FULLNAME
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
    # The restricted profile (1.20 has no Pod Security admission: the kubelet runs what the pod says).
    assert RESTRICTED_POD.items() <= spec["securityContext"].items()
    assert RESTRICTED.items() <= container["securityContext"].items()
    assert {"livenessProbe", "readinessProbe"} <= container.keys()
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, release.operator_log()
    ident = exec_in(release, pod, "id", "-u").stdout.strip()
    assert ident == "65532"
    assert "Read-only file system" in exec_in(release, pod, "touch", "/x", check=False).stderr
    # The in-cluster config the kubelet gives it: the API Service's address and the mounted token.
    env = exec_in(release, pod, "printenv", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT").stdout
    assert env.split() == [API_SERVICE_IP, "443"]
    token = exec_in(release, pod, "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token").stdout
    review = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token.strip()},
    }
    reviewed = release.node.kubectl("create", "-o", "json", "-f", "-", stdin=json.dumps(review)).stdout
    status = json.loads(reviewed)["status"]
    assert status["authenticated"], status
    assert status["user"]["username"] == f"system:serviceaccount:{RELEASE_NS}:{FULLNAME}"
    # kopf logged in and watches; through the Downgrade the API it discovered serves policy/v1
    # (LeaderWorkerSet, a CRD nobody installed, is the only API it could not find).
    log = release.operator_log(400)
    assert "Initial authentication has finished" in log, log
    # Its /healthz (kopf's liveness endpoint, both probes of the chart) answered the kubelet.
    assert re.search(r'GET /healthz HTTP/1.1\\" 200 .*kube-probe/1.20', log), log
    unresolved = [line for line in log.splitlines() if "Unresolved resources" in line]
    assert all("leaderworkersets" in line for line in unresolved), unresolved


CLIENT = f"""
import json, re, urllib.request
ui = "http://{FULLNAME}-ui.{RELEASE_NS}.svc.{CLUSTER_DOMAIN}"
out = {{}}
for path in ("/healthz", "/api/info", "/api/runs", "/"):
    with urllib.request.urlopen(ui + path, timeout=30) as reply:
        body = reply.read().decode()
        title = re.search("<title>.*</title>", body)
        out[path] = [reply.status, json.loads(body) if path != "/" else title and title[0]]
metrics = "http://{FULLNAME}-operator-metrics.{RELEASE_NS}.svc.{CLUSTER_DOMAIN}:9090/metrics"
with urllib.request.urlopen(metrics, timeout=30) as reply:
    names = sorted(set(re.findall("(?m)^(legorl_operator_[a-z_]+)", reply.read().decode())))
    out["metrics"] = [reply.status, names]
print(json.dumps(out))
"""


def client_pod(name: str, script: str) -> dict[str, Any]:
    """A restricted pod of the operator image that runs a Python SCRIPT once."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": RESTRICTED_POD,
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": OPERATOR,
                    "imagePullPolicy": "Never",
                    "command": [PYTHON, "-c", script],
                    "securityContext": RESTRICTED,
                }
            ],
        },
    }


def ensure_namespace(cluster: Node) -> None:
    if cluster.kubectl("get", "namespace", NS, check=False).returncode != 0:
        cluster.create_namespace(NS)


def test_the_ui_and_the_metrics_answer_another_pod_by_their_service_names(release: Release) -> None:
    cluster = release.node
    ensure_namespace(cluster)
    print(f"helm install -> UI Ready: {release.timings['install_to_ui_ready']:.1f} s")
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(client_pod("client", CLIENT)))

    def done() -> str | None:
        phase = cluster.get_json("pod", "client", "-n", NS)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = release.wait(done, "the client pod")
    out = cluster.kubectl("logs", "-n", NS, "client").stdout
    assert phase == "Succeeded", out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["/healthz"] == [200, {"ok": True}]
    status, info = result["/api/info"]
    assert status == 200 and info["cluster"] is True  # it runs against the cluster (in-cluster config)
    # Listing the cluster's RLRuns as the UI's own ServiceAccount worked (a refusal fills the note).
    assert result["/api/runs"] == [200, {"runs": [], "cluster_note": None}]
    assert result["/"] == [200, "<title>legorl</title>"]
    status, names = result["metrics"]
    assert status == 200 and names, result["metrics"]  # the operator's own series, by its Service


POOL: dict[str, Any] = {
    "apiVersion": "legorl.dev/v1alpha1",
    "kind": "SandboxPool",
    "metadata": {"name": POOL_NAME, "namespace": NS},
    "spec": {
        # Both have /bin/sh, which each pre-pull init container runs.
        "source": {"images": [PROXY, OPERATOR]},
        "prePull": {"pauseImage": PAUSE_IMAGE},
    },
}


def pool_condition(cluster: Node, type_: str) -> dict[str, Any] | None:
    pool = cluster.get_json("sandboxpool", POOL_NAME, "-n", NS)
    conditions = (pool.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)


def images_cached(cluster: Node, count: int) -> dict[str, Any] | None:
    cond = pool_condition(cluster, "ImagesCached")
    if cond and cond["status"] == "True" and cond["message"].startswith(f"{count} image(s)"):
        return cond
    return None


def test_a_pool_caches_its_images_on_the_real_node(release: Release) -> None:
    cluster = release.node
    ensure_namespace(cluster)
    start = time.monotonic()
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(POOL))
    cond = release.wait(lambda: images_cached(cluster, 2), "ImagesCached=True")
    release.timings["pool_to_images_cached"] = time.monotonic() - start
    print(f"pool applied -> ImagesCached=True: {release.timings['pool_to_images_cached']:.1f} s: {cond}")
    assert cond["reason"] == "AllImagesCached"
    assert cond["message"] == "2 image(s) on all 1 matching node(s)"
    # The pre-pull DaemonSet's pod runs on the node: the kubelet started each image's init container
    # (which is what ImagesCached counts: it may be True a moment before the pause container runs).
    prepull = release.wait(lambda: running(release.pod("prepull", NS)), "the pre-pull pod Running")
    assert prepull["spec"]["nodeName"] == NODE_NAME
    started = {s["image"] for s in prepull["status"]["initContainerStatuses"] if "terminated" in s["state"]}
    assert started == {PROXY, OPERATOR}
    # What the node itself reports holding agrees.
    held = {n for image in cluster.get_json("node", NODE_NAME)["status"]["images"] for n in image["names"]}
    assert {PROXY, OPERATOR} <= held
    status = cluster.get_json("sandboxpool", POOL_NAME, "-n", NS)["status"]
    assert status["nodes"] == [{"name": NODE_NAME, "desired": 2, "pulled": 2, "failed": 0, "failures": []}]
    assert status["imagesDesired"] == status["imagesCached"] == 2
    # `kubectl get sandboxpools` shows it (the CRD's printer columns), and the Events explain.
    table = cluster.kubectl("get", "sandboxpools", "-n", NS).stdout.splitlines()
    assert table[0].split()[:6] == ["NAME", "READY", "REASON", "IMAGES", "CACHED", "WARM"], table
    assert table[1].split()[:6] == [POOL_NAME, "True", "PoolReady", "2", "2", "0"], table
    events = pool_events(cluster)
    assert ("Normal", "AllImagesCached", "ImagesCached=True: 2 image(s) on all 1 matching node(s)") in events
    assert all(kind == "Normal" for kind, _, _ in events), events


def running(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    return pod if pod is not None and pod["status"].get("phase") == "Running" else None


def pool_events(cluster: Node) -> list[tuple[str, str, str]]:
    """The pool's Events (type, reason, message), oldest first, all posted by the operator."""
    got = cluster.get_json(
        "events",
        "-n",
        NS,
        "--field-selector",
        f"involvedObject.kind=SandboxPool,involvedObject.name={POOL_NAME}",
    )["items"]
    assert {e["source"].get("component") for e in got} <= {"legorl-operator"}
    got.sort(
        key=lambda e: (e.get("firstTimestamp") or e["metadata"]["creationTimestamp"], e["metadata"]["name"])
    )
    return [(e["type"], e["reason"], e["message"]) for e in got]


FLEET: dict[str, Any] = {
    "apiVersion": "legorl.dev/v1alpha1",
    "kind": "RolloutFleet",
    "metadata": {"name": "idle", "namespace": NS},
    "spec": {
        "model": {"uri": "pvc://models/tiny"},
        "replicas": 0,
        "parallelism": {"gpusPerNode": 1, "tensorParallelSize": 1},
    },
}


def test_the_operator_pod_writes_policy_v1_through_the_api_service(release: Release) -> None:
    """A fleet scaled to zero still gets its PodDisruptionBudget, which the operator applies as
    policy/v1: the pod's API path (the `kubernetes` Service) goes through the Downgrade."""
    cluster = release.node
    ensure_namespace(cluster)
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(FLEET))

    def pdb() -> dict[str, Any] | None:
        got = cluster.kubectl(
            "get",
            "poddisruptionbudget",
            "idle-engine",
            "-n",
            NS,
            "-o",
            "json",
            "--show-managed-fields",
            check=False,
        )
        return json.loads(got.stdout) if got.returncode == 0 else None

    budget = release.wait(pdb, "the fleet's PodDisruptionBudget")
    fleet = cluster.get_json("rolloutfleet", "idle", "-n", NS)
    assert [r["uid"] for r in budget["metadata"]["ownerReferences"]] == [fleet["metadata"]["uid"]]
    managers = {m["manager"]: m["apiVersion"] for m in budget["metadata"]["managedFields"]}
    assert managers.get("legorl-operator") == "policy/v1beta1", managers  # 1.20 stored what it was sent
    release.wait(
        lambda: any(c["reason"] == "ScaledToZero" for c in (fleet_status(cluster).get("conditions") or [])),
        "the fleet's Ready=False ScaledToZero",
    )


def fleet_status(cluster: Node) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get_json("rolloutfleet", "idle", "-n", NS).get("status") or {}
    return status


def owned(cluster: Node, owner_uid: str) -> list[tuple[str, str]]:
    """(kind, name) of every object of the kinds a pool or fleet makes, owned by OWNER_UID."""
    kinds = "daemonsets,deployments,replicasets,services,serviceaccounts,networkpolicies,poddisruptionbudgets"
    items = cluster.get_json(kinds, "-n", NS)["items"]
    return sorted(
        (i["kind"], i["metadata"]["name"])
        for i in items
        if any(r["uid"] == owner_uid for r in i["metadata"].get("ownerReferences") or [])
    )


def reconciled(release: Release, pod: dict[str, Any], kinds: set[str]) -> bool:
    """Whether the operator in POD has counted a reconcile of each of KINDS since it started."""
    path = f"/api/v1/namespaces/{RELEASE_NS}/pods/{pod['metadata']['name']}:9090/proxy/metrics"
    got = release.node.kubectl("get", "--raw", path, check=False)
    done = {
        m[1]
        for m in re.finditer(
            r'^legorl_operator_reconciles_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', got.stdout, re.M
        )
        if float(m[2]) > 0
    }
    return kinds <= done


def test_a_killed_operator_container_is_restarted_and_duplicates_nothing(release: Release) -> None:
    cluster = release.node
    pool = cluster.get_json("sandboxpool", POOL_NAME, "-n", NS)
    fleet = cluster.get_json("rolloutfleet", "idle", "-n", NS)
    children = {uid: owned(cluster, uid) for uid in (pool["metadata"]["uid"], fleet["metadata"]["uid"])}
    assert ("DaemonSet", f"{POOL_NAME}-prepull-0") in children[pool["metadata"]["uid"]]
    status_before = pool["status"]
    events_before = pool_events(cluster)
    before = release.ready_pod("operator")
    assert before is not None
    restarts = before["status"]["containerStatuses"][0]["restartCount"]
    # SIGKILL the operator's process: the container's main process, found through the node's engine
    # (and checked to be one of the node's pods' processes).
    container_id = before["status"]["containerStatuses"][0]["containerID"].removeprefix("docker://")
    pid = int(cluster.docker("inspect", "-f", "{{.State.Pid}}", container_id).stdout)
    assert pid in pids_in_cgroup(cluster.netns)
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "legorl"
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        pod = release.ready_pod("operator")
        return pod if pod and pod["status"]["containerStatuses"][0]["restartCount"] > restarts else None

    after = release.wait(restarted, "the operator's container restarted and Ready")
    release.timings["kill_to_operator_ready"] = time.monotonic() - start
    print(f"SIGKILL -> operator Ready again: {release.timings['kill_to_operator_ready']:.1f} s")
    # The kubelet restarted the container in the same pod; the Deployment made no other.
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    last = after["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 137 and last["reason"] == "Error", last
    # The restarted operator reconciled the pool and the fleet again (its own metrics, read through
    # the API server's pod proxy), and found nothing to change.
    release.wait(
        lambda: reconciled(release, after, {"SandboxPool", "RolloutFleet"}), "reconciles after the restart"
    )
    print(f"SIGKILL -> both reconciled again: {time.monotonic() - start:.1f} s")
    assert cluster.get_json("sandboxpool", POOL_NAME, "-n", NS)["status"] == status_before
    assert pool_events(cluster) == events_before
    for uid, objects in children.items():
        assert owned(cluster, uid) == objects
    # And it reconciles: a spec change rolls the pre-pull DaemonSet in place (same name, one pod).
    cluster.kubectl(
        "patch", "sandboxpool", POOL_NAME, "-n", NS, "--type=merge",
        "-p", json.dumps({"spec": {"source": {"images": [PROXY]}}}),
    )  # fmt: skip
    changed = time.monotonic()
    release.wait(lambda: images_cached(cluster, 1), "ImagesCached=True for the one image left")
    print(f"spec change -> ImagesCached=True (1 image): {time.monotonic() - changed:.1f} s")
    assert owned(cluster, pool["metadata"]["uid"]) == children[pool["metadata"]["uid"]]

    def one_prepull_pod() -> dict[str, Any] | None:
        pod = running(release.pod("prepull", NS))
        if pod is None:
            return None
        images = [c["image"] for c in pod["spec"]["initContainers"]]
        return pod if images == [PROXY] else None

    release.wait(one_prepull_pod, "the pre-pull pod of the new template")
    print(f"spec change -> the new pre-pull pod Running: {time.monotonic() - changed:.1f} s")
    assert release.pod("operator") is not None
    assert cluster.get_json("deployment", f"{FULLNAME}-operator", "-n", RELEASE_NS)["status"]["replicas"] == 1


def test_stopping_the_node_leaves_nothing_of_the_release(release: Release) -> None:
    """The Downgrade's process, the operator's and the UI's containers end with the node."""
    cluster = release.node
    seen = cluster.observe()
    assert "downgrade" in {p.name for p in cluster.procs}
    in_pods = {seen[pid][1] for pid in cluster.pod_pids() if pid in seen}
    assert {"pause", "legorl"} <= in_pods, in_pods
    cluster.stop()
    release.timings["stop"] = cluster.timings["stop"]
    assert cluster.leftovers() == []
    assert pids_in_cgroup(cluster.netns) == []
    assert not Path(f"/run/netns/{cluster.netns}").exists()
