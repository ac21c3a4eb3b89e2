"""legorl's own images on a real kubelet: a one-node Kubernetes 1.20 cluster in a network namespace.

tests/support/kubenode.py starts the node (control plane, dockerd, kubelet, kube-proxy, CNI bridge, dnsmasq
as the cluster DNS) inside a network namespace with no route off the machine. These tests show a
legorl image runs there under the restricted pod security profile, that a pod reaches the API server
and a Service by its DNS name but nothing outside (ENETUNREACH, asserted by errno), and that stopping
the node leaves no process, namespace or cgroup behind.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kubenode import (
    API_SERVICE_IP,
    CLUSTER_DOMAIN,
    LOCK,
    NODE_IP,
    NODE_NAME,
    POD_CIDR,
    RESTRICTED,
    RESTRICTED_POD,
    STATE,
    Node,
    node,
    pids_in_cgroup,
    pids_in_netns,
    skip_unless_node_can_run,
)

PROXY = "ghcr.io/legorl/proxy:0.1.0"
OPERATOR = "ghcr.io/legorl/operator:0.1.0"
NS = "legorl-e2e"
PYTHON = "/opt/legorl/venv/bin/python"

skip_unless_node_can_run([PROXY, OPERATOR])

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with node(tmp_path_factory.mktemp("node")) as n:
        n.create_namespace(NS)
        yield n


def pod(name: str, image: str, args: list[str], **container: Any) -> dict[str, Any]:
    """A restricted pod of one container running IMAGE with ARGS (a Python script if image is ours
    and args start with `-c`), never pulled."""
    command = {"command": [PYTHON]} if args[:1] == ["-c"] else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": RESTRICTED_POD,
            "enableServiceLinks": False,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    **command,
                    "args": args,
                    "securityContext": RESTRICTED,
                    **container,
                }
            ],
        },
    }


def apply(cluster: Node, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(obj))


def wait_phase(cluster: Node, name: str, phases: set[str], timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        got: dict[str, Any] = cluster.get_json("pod", name, "-n", NS)
        if got["status"].get("phase") in phases:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(
                f"pod {name} not {phases} in {timeout:.0f} s: {json.dumps(got['status'])}\n"
                f"--- kubelet\n{cluster.tail('kubelet')}"
            )
        time.sleep(1)


def logs(cluster: Node, name: str) -> str:
    return cluster.kubectl("logs", "-n", NS, name).stdout


def script_result(cluster: Node, name: str, script: str, timeout: float = 180) -> dict[str, Any]:
    """Run SCRIPT (Python, printing one JSON line last) in a restricted pod of the operator image."""
    apply(cluster, pod(name, OPERATOR, ["-c", script]))
    got = wait_phase(cluster, name, {"Succeeded", "Failed"}, timeout)
    out = logs(cluster, name)
    assert got["status"]["phase"] == "Succeeded", out
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def test_the_node_registers_and_is_ready(cluster: Node) -> None:
    got = cluster.get_json("node", NODE_NAME)
    ready = next(c for c in got["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    assert {"type": "InternalIP", "address": NODE_IP} in got["status"]["addresses"]
    info = got["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.20.2"
    assert info["containerRuntimeVersion"].startswith("docker://")
    # The kubelet's namespace still has no way out (the fixture asserted it before starting it).
    routes = subprocess.run(
        ["ip", "-n", cluster.netns, "route", "show", "default"], capture_output=True, text=True, check=True
    )
    assert routes.stdout.strip() == ""
    print(f"node timings (s): {json.dumps({k: round(v, 1) for k, v in cluster.timings.items()})}")


def test_the_proxy_image_runs_under_the_restricted_profile(cluster: Node) -> None:
    proxy = pod(
        "proxy",
        PROXY,
        [
            "proxy",
            "--listen=0.0.0.0:4000",
            "--upstream=http://127.0.0.1:9",
            "--journal=/journal",
            "--trial=t0",
        ],
        volumeMounts=[{"name": "journal", "mountPath": "/journal"}],
        readinessProbe={"httpGet": {"path": "/healthz", "port": 4000}, "periodSeconds": 1},
    )
    proxy["spec"]["volumes"] = [{"name": "journal", "emptyDir": {}}]
    start = time.monotonic()
    apply(cluster, proxy)
    cluster.kubectl("wait", "-n", NS, "--for=condition=Ready", "pod/proxy", "--timeout=180s", timeout=200)
    print(f"proxy pod Ready {time.monotonic() - start:.1f} s after it was created")
    got = cluster.get_json("pod", "proxy", "-n", NS)
    assert got["status"]["phase"] == "Running"
    assert got["status"]["podIP"].startswith(POD_CIDR.rsplit(".", 2)[0])
    assert "listening on 0.0.0.0:4000" in logs(cluster, "proxy")
    # exec through the API server and the kubelet: the image's own user, a read-only root.
    ident = cluster.kubectl("exec", "-n", NS, "proxy", "--", "id", "-u").stdout.strip()
    assert ident == "65533"
    write = cluster.kubectl("exec", "-n", NS, "proxy", "--", "touch", "/x", check=False)
    assert write.returncode != 0
    assert "Read-only file system" in write.stderr


CONTAINMENT = f"""
import json, socket, ssl, urllib.request
result = {{}}
for host, port in (("1.1.1.1", 443), ("169.254.169.254", 80)):
    s = socket.socket()
    s.settimeout(10)
    result[host] = s.connect_ex((host, port))
    s.close()
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
context = ssl.create_default_context(cafile=sa + "/ca.crt")
token = open(sa + "/token").read()
headers = {{"Authorization": "Bearer " + token}}
request = urllib.request.Request("https://{API_SERVICE_IP}/version", headers=headers)
with urllib.request.urlopen(request, context=context, timeout=20) as reply:
    result["api"] = [reply.status, json.load(reply)["gitVersion"]]
print(json.dumps(result))
"""


def test_a_pod_reaches_the_api_server_and_nothing_outside(cluster: Node) -> None:
    result = script_result(cluster, "containment", CONTAINMENT)
    print(f"from a pod: {result}")
    assert result["1.1.1.1"] == 101, result  # ENETUNREACH: no route, no packet left
    assert result["169.254.169.254"] == 101, result
    assert result["api"] == [200, "v1.20.2"]


DNS = f"""
import json, socket, time, urllib.request
name = "web.{NS}.svc.{CLUSTER_DOMAIN}"
deadline, last = time.monotonic() + 90, None
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen("http://" + name + "/", timeout=5) as reply:
            status = reply.status
            break
    except OSError as exc:
        last = repr(exc)
        time.sleep(1)
else:
    raise SystemExit("no answer from " + name + ": " + str(last))
result = {{"status": status, "web": socket.gethostbyname(name), "short": socket.gethostbyname("web")}}
result["kubernetes"] = socket.gethostbyname("kubernetes.default.svc.{CLUSTER_DOMAIN}")
try:
    result["outside"] = socket.getaddrinfo("example.com", 443)[0][4][0]
except socket.gaierror as exc:
    result["outside"] = exc.args[1]
print(json.dumps(result))
"""


def test_a_service_answers_by_its_dns_name(cluster: Node) -> None:
    server = pod(
        "web",
        OPERATOR,
        ["-m", "http.server", "8080", "--directory", "/tmp"],
        command=[PYTHON],
        readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1},
    )
    apply(cluster, server)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    apply(cluster, service)
    cluster_ip = cluster.get_json("service", "web", "-n", NS)["spec"]["clusterIP"]
    start = time.monotonic()
    result = script_result(cluster, "client", DNS)
    print(f"from a pod, {time.monotonic() - start:.1f} s after the Service was made: {result}")
    assert result["status"] == 200
    assert result["web"] == result["short"] == cluster_ip
    assert result["kubernetes"] == API_SERVICE_IP
    assert not result["outside"][0].isdigit(), result  # an error message, not an address


def test_stopping_the_node_leaves_nothing(cluster: Node) -> None:
    before = cluster.saved_sysctls
    sysctls = {name: Path("/proc/sys", name).read_text().strip() for name in before}
    seen = cluster.observe()
    names = {name for _, name in seen.values()}
    # What was running: the node's programs, the runtime's, and the pods' (the web server still runs).
    assert {"kubelet", "dockerd", "containerd", "etcd", "kube-apiserver", "dnsmasq"} <= names, names
    assert any(n.startswith("containerd-shim") for n in names), names
    in_pods = {seen[pid][1] for pid in cluster.pod_pids() if pid in seen}
    assert {"pause", "python"} <= in_pods, in_pods
    cgroup = Path("/sys/fs/cgroup/memory") / cluster.netns
    assert cgroup.is_dir()
    netns = Path(f"/run/netns/{cluster.netns}").stat()

    cluster.stop()
    print(f"stopped in {cluster.timings['stop']:.1f} s")

    assert cluster.leftovers() == []
    assert pids_in_netns((netns.st_dev, netns.st_ino)) == []  # nothing keeps the namespace alive either
    assert pids_in_cgroup(cluster.netns) == []
    assert not Path(f"/run/netns/{cluster.netns}").exists()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert cluster.netns not in listed
    assert not cgroup.exists()
    assert not STATE.exists()
    after = {name: Path("/proc/sys", name).read_text().strip() for name in before}
    assert after == before, f"sysctls while the node ran: {sysctls}"
    with LOCK.open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it any more
